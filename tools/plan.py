"""Plan the parallel layout of a training job: a ranked table of predicted step time, throughput and memory.

    python tools/plan.py --config configs/ernie.yaml --cluster a100-80gb --gpus 64 --global-batch 512
    python tools/plan.py --config MODEL.yaml --cluster h100-80gb --gpus 3072 --json --top 3
    python tools/plan.py --config MODEL.yaml --cluster a100-80gb --gpus 512 \
        --evaluate "parallel.tp=8 parallel.pp=2 model.recompute=full"   # fix some settings, search the rest
    python tools/plan.py --config MODEL.yaml --cluster a100-80gb --gpus 64 --write best.yaml --plot plan.png
    python tools/plan.py --profile-local --output configs/clusters/local.yaml   # measure this machine
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from llmtrain.config import ConfigError, load
from llmtrain.planner import Software, load_cluster, parse_fixed, plan_job
from llmtrain.planner.report import format_table, plot, to_records, write_config

SOFTWARE = {"llmtrain": Software(), "megatron-2021": Software.megatron_2021()}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, plan, print; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="model/job YAML (the model, precision and batch come from it)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the config")
    parser.add_argument(
        "--cluster", default="a100-80gb", help="cluster YAML or preset name (a100-80gb, h100-80gb)"
    )
    parser.add_argument("--gpus", type=int, help="number of GPUs")
    parser.add_argument(
        "--global-batch", type=int, help="samples per step (default: train.global_batch_size)"
    )
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    parser.add_argument(
        "--evaluate", help='fix settings, e.g. "parallel.tp=8 parallel.pp=2"; search the rest'
    )
    parser.add_argument("--write", help="write the best layout as a training config YAML")
    parser.add_argument("--plot", help="draw time and memory breakdowns of the top layouts to this image")
    parser.add_argument(
        "--software", choices=sorted(SOFTWARE), default="llmtrain", help="framework behaviour"
    )
    parser.add_argument(
        "--profile-local", action="store_true", help="measure this machine, write a cluster file"
    )
    parser.add_argument(
        "--output", default="local-cluster.yaml", help="cluster file written by --profile-local"
    )
    parser.add_argument(
        "--devices", type=int, default=2, help="processes sharing this machine (--profile-local)"
    )
    args = parser.parse_args(argv)
    try:
        if args.profile_local:
            from llmtrain.planner.profile import describe_local

            desc = describe_local(args.devices)
            with open(args.output, "w") as fh:
                yaml.safe_dump(desc, fh, sort_keys=False)
            print(f"wrote {args.output}:\n{yaml.safe_dump(desc, sort_keys=False)}")
            return 0
        if not args.config or not args.gpus:
            parser.error("--config and --gpus are required (or use --profile-local)")
        job = load(args.config, args.overrides)
        result = plan_job(
            job,
            load_cluster(args.cluster),
            args.gpus,
            global_batch=args.global_batch,
            fixed=parse_fixed(args.evaluate),
            software=SOFTWARE[args.software],
            top=args.top,
        )
        if args.json:
            print(json.dumps(to_records(result, args.top), indent=1))
        else:
            print(format_table(result, args.top))
        if args.write:
            if not result.best.fits:
                raise ConfigError(
                    f"no layout fits in memory ({result.best.why}); nothing written to {args.write}"
                )
            write_config(job, result.best, args.write, result.workload.global_batch)
            print(f"wrote {args.write} ({result.best.layout.short()})", file=sys.stderr)
        if args.plot:
            plot(result, args.plot, args.top)
            print(f"wrote {args.plot}", file=sys.stderr)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
