"""Convert model directories between the Hugging Face layout and llmtrain's.

python tools/convert_checkpoint.py hf-to-llmtrain --input HF_DIR --output OUT_DIR
python tools/convert_checkpoint.py llmtrain-to-hf --input LLMTRAIN_DIR --output OUT_DIR
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.models.hf import convert_hf_to_llmtrain, convert_llmtrain_to_hf

COMMANDS = {"hf-to-llmtrain": convert_hf_to_llmtrain, "llmtrain-to-hf": convert_llmtrain_to_hf}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one conversion; errors print one line and exit 1."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in COMMANDS.items():
        cmd = sub.add_parser(name, help=fn.__doc__)
        cmd.add_argument("--input", required=True, help="source model directory")
        cmd.add_argument("--output", required=True, help="destination directory (written atomically)")
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command](args.input, args.output)
    except (OSError, ValueError) as err:
        print(f"convert_checkpoint: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
