r"""Run a grid (or list) of config overrides as separate training runs and tabulate the results.

    python tools/sweep.py --config configs/gpt-small.yaml --grid "parallel.tp=1,2 train.lr=1e-3,3e-4" \
        --output runs/sweep [--launcher "torchrun --nproc_per_node 2"] [--parallel 2] [train.steps=50 ...]

Fixed `key.path=value` overrides (given to every run) go anywhere among the options, or after `--`.
Each run goes to OUTPUT/<run-name>; a re-run skips the finished ones and appends to the others' logs;
OUTPUT/summary.{csv,md} and PNG plots are written at the end. Exits 1 when any run failed (the others
still ran), 2 on a bad sweep description.
"""

from __future__ import annotations

import argparse

from llmtrain.cli import add_debug_flag, run_tool


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="base YAML job config")
    points = parser.add_mutually_exclusive_group(required=True)
    points.add_argument("--grid", help='axes "key.path=v1,v2 key2=a,b": every combination is run')
    points.add_argument("--list", help="YAML list of override mappings, one run each")
    parser.add_argument("--output", required=True, help="sweep directory (one sub-directory per run)")
    parser.add_argument("--launcher", help='replaces `python`, e.g. "torchrun --nproc_per_node 4"')
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--timeout", type=float, help="seconds before a run is killed and recorded as failed")
    parser.add_argument("--script", help="training script (default: tools/pretrain.py)")
    parser.add_argument("overrides", nargs="*", help="fixed key.path=value overrides for every run")
    add_debug_flag(parser)
    return parser


def main(argv: list[str]) -> int:
    # Options and fixed overrides may interleave: `--config c.yaml train.steps=5 --grid ... --output o`.
    args = build_parser().parse_intermixed_args(argv)
    from llmtrain.sweep import load_list, parse_grid, run_sweep, summarize
    from llmtrain.sweep.runner import DEFAULT_SCRIPT

    sweep_points = parse_grid(args.grid) if args.grid else load_list(args.list)
    results = run_sweep(
        args.config,
        sweep_points,
        args.output,
        extra=args.overrides,
        launcher=args.launcher,
        parallel=args.parallel,
        script=args.script or DEFAULT_SCRIPT,
        timeout_s=args.timeout,
    )
    print(summarize(results, args.output))
    print(f"\nwritten: {args.output}/summary.csv, summary.md, *.png")
    return 0 if all(r.status == "done" for r in results) else 1


if __name__ == "__main__":
    run_tool(main)
