"""Tokenize JSONL, text, Parquet or a saved `datasets` dataset into Megatron-format indexed datasets.

Empty documents are skipped and counted. A record that cannot be read (invalid JSON or UTF-8, a missing
key, a value that is not a string) is skipped, counted and the first few named, unless
--on-bad-document error; an input none of whose first records is readable stops the run (a wrong
--json-keys or format). The outputs appear only when complete; an existing one is kept unless --overwrite.
"""

from __future__ import annotations

import argparse
import os

from llmtrain.cli import add_debug_flag, add_on_bad_document_flag, run_tool


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".jsonl(.gz), .txt (a document per line), .parquet, or a datasets.save_to_disk directory",
    )
    ap.add_argument(
        "--output-prefix", required=True, help="outputs are OUTPUT_PREFIX_{key}_document.bin/.idx"
    )
    ap.add_argument(
        "--tokenizer-model",
        required=True,
        help="SentencePiece .model file or Hugging Face tokenizer directory (tokenizer.json)",
    )
    ap.add_argument(
        "--json-keys", nargs="+", default=["text"], help="fields (columns) to tokenize, one dataset each"
    )
    ap.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document token to every document"
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    add_on_bad_document_flag(ap)
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    ap.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    add_debug_flag(ap)
    return ap


def main(argv: list[str]) -> int:
    """Preprocess; writes OUTPUT_PREFIX_{key}_document.{bin,idx} per key."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be at least 1; got {args.workers}")
    import signal
    import sys

    from llmtrain.data.preprocess import preprocess_files

    stopped_by: list[str] = []

    def on_sigterm(signum: int, frame: object) -> None:
        stopped_by.append("SIGTERM")
        raise KeyboardInterrupt

    # SIGTERM (kill, a scheduler's time limit) unwinds like Ctrl-C, so the partial output is removed.
    signal.signal(signal.SIGTERM, on_sigterm)
    # Python raises KeyboardInterrupt only if SIGINT was not ignored when it started; a shell's background
    # job (a script, CI) starts with it ignored, and SIGINT must still stop the tool cleanly there.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        results = preprocess_files(
            args.input,
            args.output_prefix,
            args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            on_bad_document=args.on_bad_document,
            overwrite=args.overwrite,
            log_interval=args.log_interval,
        )
    except KeyboardInterrupt:
        how = stopped_by[0] if stopped_by else "Ctrl-C"
        print(f"preprocess_data: stopped by {how}; nothing was written", file=sys.stderr)
        return 128 + (signal.SIGTERM if stopped_by else signal.SIGINT)
    for prefix, stats in results.items():
        print(f"wrote {prefix}.bin and {prefix}.idx: {stats.documents:,} documents, {stats.tokens:,} tokens")
    return 0


if __name__ == "__main__":
    run_tool(main)
