"""Run a grid (or list) of config overrides as separate training runs and tabulate the results.

    python tools/sweep.py --config configs/tiny.yaml --grid "parallel.tp=1,2 train.micro_batch_size=1,2" \
        --output runs/sweep [--launcher "torchrun --nproc_per_node 2"] [--parallel 2] [-- train.steps=50]

Each run goes to OUTPUT/<run-name>; a re-run skips the finished ones; OUTPUT/summary.{csv,md} and
PNG plots are written at the end. Exits 1 when any run failed (the others still ran).
"""

from __future__ import annotations

import argparse
import sys

from llmtrain.sweep import load_list, parse_grid, run_sweep, summarize
from llmtrain.sweep.runner import DEFAULT_SCRIPT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` is passed to every run unchanged.
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="base YAML job config")
    points = parser.add_mutually_exclusive_group(required=True)
    points.add_argument("--grid", help='axes "key.path=v1,v2 key2=a,b": every combination is run')
    points.add_argument("--list", help="YAML list of override mappings, one run each")
    parser.add_argument("--output", required=True, help="sweep directory (one sub-directory per run)")
    parser.add_argument("--launcher", help='replaces `python`, e.g. "torchrun --nproc_per_node 4"')
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--timeout", type=float, help="seconds before a run is killed and recorded as failed")
    parser.add_argument("--script", default=str(DEFAULT_SCRIPT), help="training script (tools/pretrain.py)")
    args = parser.parse_args(own)
    try:
        sweep_points = parse_grid(args.grid) if args.grid else load_list(args.list)
        results = run_sweep(
            args.config,
            sweep_points,
            args.output,
            extra=extra,
            launcher=args.launcher,
            parallel=args.parallel,
            script=args.script,
            timeout_s=args.timeout,
        )
    except ValueError as err:
        print(f"sweep error: {err}", file=sys.stderr)
        return 2
    print(summarize(results, args.output))
    print(f"\nwritten: {args.output}/summary.csv, summary.md, *.png")
    return 0 if all(r.status == "done" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
