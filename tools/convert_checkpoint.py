"""Convert between Hugging Face model directories and llmtrain models or sharded checkpoints.

python tools/convert_checkpoint.py hf-to-llmtrain --input HF_DIR --output OUT_DIR [--tp N --pp N --dp N]
python tools/convert_checkpoint.py llmtrain-to-hf --input MODEL_OR_CKPT --output HF_DIR [--max-shard-gb G]
python tools/convert_checkpoint.py reshard --input CHECKPOINT --output OUT_DIR --tp N --pp N --dp N
python tools/convert_checkpoint.py inspect --input CHECKPOINT [--json]

Without --tp/--pp/--dp, hf-to-llmtrain writes a single llmtrain model directory; with them, a sharded
checkpoint that a run starts from with checkpoint.load=OUT_DIR. llmtrain-to-hf takes either kind.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmtrain.checkpoint import CheckpointError
from llmtrain.checkpoint import convert as sharded
from llmtrain.models.hf import convert_hf_to_llmtrain, convert_llmtrain_to_hf


def _layout_args(cmd: argparse.ArgumentParser, required: bool) -> None:
    for name in ("tp", "pp", "dp"):
        cmd.add_argument(f"--{name}", type=int, required=required and name != "dp", help=f"{name} degree")


def run(args: argparse.Namespace) -> str:
    """Carry out one subcommand; returns what to print."""
    if args.command == "hf-to-llmtrain":
        if args.tp is None and args.pp is None and args.dp is None:
            convert_hf_to_llmtrain(args.input, args.output)
        else:
            sharded.from_hf(args.input, args.output, args.tp or 1, args.pp or 1, args.dp or 1)
        return f"wrote {args.output}"
    if args.command == "llmtrain-to-hf":
        if sharded.is_sharded_checkpoint(args.input):
            sharded.to_hf(args.input, args.output, max_shard_bytes=int(args.max_shard_gb * 2**30))
        else:
            convert_llmtrain_to_hf(args.input, args.output)
        return f"wrote {args.output}"
    if args.command == "reshard":
        sharded.reshard(args.input, args.output, args.tp, args.pp, args.dp or 1)
        return f"wrote {args.output}"
    if args.json:
        return json.dumps(sharded.info(args.input), indent=1)
    return sharded.describe(args.input)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand; errors print one line and exit 1."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    to_llmtrain = sub.add_parser(
        "hf-to-llmtrain", help="Hugging Face directory -> llmtrain model or checkpoint"
    )
    to_hf = sub.add_parser("llmtrain-to-hf", help="llmtrain model or sharded checkpoint -> Hugging Face")
    reshard = sub.add_parser("reshard", help="rewrite a sharded checkpoint chunked for another layout")
    inspect = sub.add_parser("inspect", help="print a checkpoint's layout, step, tensors and sizes")
    for cmd in (to_llmtrain, to_hf, reshard, inspect):
        cmd.add_argument("--input", required=True, help="source directory")
    for cmd in (to_llmtrain, to_hf, reshard):
        cmd.add_argument("--output", required=True, help="destination directory (written atomically)")
    _layout_args(to_llmtrain, required=False)
    _layout_args(reshard, required=True)
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        print(run(args))
    except (OSError, ValueError, CheckpointError) as err:
        print(f"convert_checkpoint: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
