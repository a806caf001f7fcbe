"""Tokenize JSONL, text, Parquet or a saved `datasets` dataset into Megatron-format indexed datasets."""

from __future__ import annotations

import argparse
import os
import sys

from llmtrain.data.errors import DataError
from llmtrain.data.preprocess import preprocess_files


def main(argv: list[str] | None = None) -> None:
    """Parse Megatron-style arguments and preprocess; writes PREFIX_{key}_document.{bin,idx} per key."""
    ap = argparse.ArgumentParser(description=__doc__)
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
    ap.add_argument("--skip-empty", action="store_true", help="drop empty documents instead of failing")
    ap.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be at least 1; got {args.workers}")
    try:
        results = preprocess_files(
            args.input,
            args.output_prefix,
            args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            skip_empty=args.skip_empty,
            log_interval=args.log_interval,
        )
    except DataError as e:
        sys.exit(f"error: {e}")
    for prefix in results:
        print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
