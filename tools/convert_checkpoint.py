"""Convert between Hugging Face model directories and llmtrain models or sharded checkpoints.

python tools/convert_checkpoint.py hf-to-llmtrain --input HF_DIR --output OUT_DIR [--tp N --pp N --dp N]
python tools/convert_checkpoint.py llmtrain-to-hf --input MODEL_OR_CKPT --output HF_DIR [--max-shard-gb G]
    [--tokenizer PATH | --no-tokenizer]
python tools/convert_checkpoint.py reshard --input CHECKPOINT --output OUT_DIR --tp N --pp N --dp N
python tools/convert_checkpoint.py inspect --input CHECKPOINT [--json]

Without --tp/--pp/--dp, hf-to-llmtrain writes a single llmtrain model directory; with them, a sharded
checkpoint that a run starts from with checkpoint.load=OUT_DIR (its input may then also be an llmtrain model
directory). An existing non-empty OUT_DIR is refused unless --overwrite is given. llmtrain-to-hf takes either
kind and writes the tokenizer the input carries (a checkpoint keeps its run's tokenizer) as Hugging Face
tokenizer files, so AutoTokenizer.from_pretrained loads it too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmtrain.cli import add_debug_flag, run_tool


def _layout_args(cmd: argparse.ArgumentParser, required: bool) -> None:
    for name in ("tp", "pp", "dp"):
        cmd.add_argument(f"--{name}", type=int, required=required and name != "dp", help=f"{name} degree")


def parse(argv: list[str]) -> argparse.Namespace:
    """The subcommand and its arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    to_llmtrain = sub.add_parser(
        "hf-to-llmtrain", help="Hugging Face directory -> llmtrain model or checkpoint"
    )
    to_hf = sub.add_parser("llmtrain-to-hf", help="llmtrain model or sharded checkpoint -> Hugging Face")
    reshard = sub.add_parser("reshard", help="rewrite a sharded checkpoint chunked for another layout")
    inspect = sub.add_parser("inspect", help="print a checkpoint's layout, step, tensors and sizes")
    for cmd in (to_llmtrain, to_hf, reshard, inspect):
        cmd.add_argument("--input", required=True, help="source directory")
        add_debug_flag(cmd)
    for cmd in (to_llmtrain, to_hf, reshard):
        cmd.add_argument("--output", required=True, help="destination directory (written atomically)")
        cmd.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output")
    _layout_args(to_llmtrain, required=False)
    _layout_args(reshard, required=True)
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    tokenizer = to_hf.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        help="SentencePiece .model or Hugging Face tokenizer directory to export (default: the input's own)",
    )
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="export the model without a tokenizer")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run one subcommand; a bad input raises a UserError, which run_tool prints as one line."""
    args = parse(argv)
    from llmtrain.checkpoint import convert
    from llmtrain.checkpoint.errors import CheckpointError

    output = Path(args.output) if args.command != "inspect" else None
    if output is not None and not args.overwrite and output.is_dir() and any(output.iterdir()):
        # An earlier export may have been edited or shipped since: replacing it is the user's call.
        raise CheckpointError(
            f"--output {output} already exists and is not empty; choose a new --output, or pass --overwrite "
            "to replace it"
        )
    try:
        if args.command == "hf-to-llmtrain":
            convert.import_model(args.input, args.output, args.tp, args.pp, args.dp)
            print(f"wrote {args.output}")
        elif args.command == "llmtrain-to-hf":
            max_shard_bytes = int(args.max_shard_gb * 2**30)
            source = convert.to_hf(
                args.input, args.output, max_shard_bytes, args.tokenizer, not args.no_tokenizer
            )
            if source is not None:
                print(f"wrote {args.output} (model and the tokenizer of {source})")
            else:
                why = (
                    "as asked"
                    if args.no_tokenizer
                    else f"{args.input} carries none; add one with --tokenizer"
                )
                print(f"wrote {args.output} (model only, no tokenizer: {why})")
        elif args.command == "reshard":
            convert.reshard(args.input, args.output, args.tp, args.pp, args.dp or 1)
            print(f"wrote {args.output}")
        else:
            print(
                json.dumps(convert.info(args.input), indent=1) if args.json else convert.describe(args.input)
            )
    except OSError as err:  # a file system refusal (permissions, space): the user's to fix, not a bug
        raise CheckpointError(f"{err.filename or args.input}: {err.strerror or err}") from err
    return 0


if __name__ == "__main__":
    run_tool(main)
