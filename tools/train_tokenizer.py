"""Train a byte-fallback SentencePiece tokenizer (BPE or unigram) from text, JSONL, Parquet or datasets.

Unreadable records are skipped and counted unless --on-bad-document error (as in preprocess_data.py);
an existing PREFIX.model is kept unless --overwrite.
"""

from __future__ import annotations

import argparse

from llmtrain.cli import add_debug_flag, add_on_bad_document_flag, run_tool


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="text (.txt: a document per line), .jsonl, .parquet files or datasets.save_to_disk directories",
    )
    ap.add_argument("--model-prefix", required=True, help="output path without .model")
    ap.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    ap.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    ap.add_argument("--json-keys", nargs="+", default=["text"], help="fields (columns) holding the text")
    ap.add_argument("--user-defined-symbols", nargs="*", default=[], help="extra pieces kept whole")
    ap.add_argument(
        "--input-sentence-size",
        type=int,
        default=1_000_000,
        help="lines sampled for training (bounds time and memory)",
    )
    add_on_bad_document_flag(ap)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    ap.add_argument("--verbose", action="store_true", help="show SentencePiece's own training log")
    ap.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    add_debug_flag(ap)
    return ap


def main(argv: list[str]) -> int:
    """Train; writes PREFIX.model."""
    args = parser().parse_args(argv)
    from llmtrain.data.tokenizer_training import train_tokenizer_files

    out = train_tokenizer_files(
        args.input,
        args.model_prefix,
        args.vocab_size,
        json_keys=args.json_keys,
        model_type=args.model_type,
        user_defined_symbols=args.user_defined_symbols,
        input_sentence_size=args.input_sentence_size,
        on_bad_document=args.on_bad_document,
        overwrite=args.overwrite,
        verbose=args.verbose,
        interval=args.log_interval,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_tool(main)
