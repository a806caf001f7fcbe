"""Train a model: `python tools/pretrain.py --config configs/ernie.yaml [key.path=value ...]`.

Runs on one process with `python`, or on many with `torchrun --nproc_per_node N tools/pretrain.py ...`.
Rerunning a command resumes the run in its output_dir; Ctrl-C (SIGINT) or SIGTERM saves a checkpoint first.
Exit status: 0 done (or nothing to do), 2 bad input, 3 training diverged, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.cli import add_debug_flag, launch_rank, run_tool


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML job config, e.g. configs/ernie.yaml")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=20")
    add_debug_flag(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from llmtrain.config import load
    from llmtrain.training.interrupt import exit_code

    try:
        job = load(args.config, args.overrides)  # before importing torch: a bad config answers at once
        from llmtrain.training.run import run

        result = run(job)
    except KeyboardInterrupt:  # Ctrl-C before training started: there is no work to save yet
        if launch_rank() == 0:
            print("interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
        return exit_code(2)
    if launch_rank() == 0:
        print(result.summary(), flush=True)
    return result.exit_code


if __name__ == "__main__":
    run_tool(main)
