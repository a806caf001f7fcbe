"""Validate the planner's cost model against Megatron-LM's published A100 runs (Narayanan et al. 2021).

    python benchmarks/validate_planner.py [--cluster a100-80gb] [--reference PATH] [--json out.json]

Prints, per published configuration, the measured and predicted TFLOP/s per GPU and the error, the
median and max |error| (targets 5% and 10%), and the planner's own best layout with its predicted speedup
over the published one (target >= 1). The reference lives at ../shared/reference/megatron_a100_2021.csv
relative to the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmtrain.config import ConfigError
from llmtrain.planner.validation import format_results, summary, validate_megatron


def main(argv: list[str] | None = None) -> int:
    """Run the validation and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", default="a100-80gb", help="cluster YAML or preset (one for every row)")
    parser.add_argument("--reference", help="published table CSV (default ../shared/reference/...)")
    parser.add_argument("--json", help="also write the per-row results to this JSON file")
    args = parser.parse_args(argv)
    try:
        results = validate_megatron(args.cluster, args.reference)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_results(results))
    if args.json:
        rows = [
            dict(
                r.row,
                predicted_tflops=r.predicted_tflops,
                error=r.error,
                interleaved_tflops=r.interleaved_tflops,
                published_layout=r.published.layout.short(),
                best_layout=r.best.layout.short(),
                best_speedup=r.best_speedup,
            )
            for r in results
        ]
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "summary": summary(results)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
