"""Train a byte-fallback SentencePiece tokenizer (BPE or unigram) from text, JSONL, Parquet or datasets."""

from __future__ import annotations

import argparse
import sys

from llmtrain.data.errors import DataError
from llmtrain.data.sources import iter_documents
from llmtrain.data.tokenizer import train_sentencepiece


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and train; writes PREFIX.model."""
    ap = argparse.ArgumentParser(description=__doc__)
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
    args = ap.parse_args(argv)
    try:
        out = train_sentencepiece(
            iter_documents(args.input, args.json_keys),
            args.model_prefix + ".model",
            args.vocab_size,
            model_type=args.model_type,
            user_defined_symbols=args.user_defined_symbols,
            input_sentence_size=args.input_sentence_size,
        )
    except DataError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
