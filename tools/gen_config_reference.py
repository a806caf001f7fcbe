"""Write docs/configuration.md from the config dataclasses' docstrings, or check that it is current.

python tools/gen_config_reference.py          # regenerate
python tools/gen_config_reference.py --check  # exit 1 if the file is stale (CI)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmtrain.cli import add_debug_flag, run_tool

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default docs/configuration.md")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    from llmtrain.config.reference import generate, missing_docs

    problems = missing_docs()
    if problems:
        print("config fields need a one-line docstring:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    text = generate()
    if args.check:
        if not args.output.is_file() or args.output.read_text() != text:
            print(f"{args.output} is stale; run: python tools/gen_config_reference.py", file=sys.stderr)
            return 1
        print(f"{args.output} is current")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_tool(main)
