"""Validate the planner's cost model against Megatron-LM's published A100 runs (Narayanan et al. 2021).

    python benchmarks/validate_planner.py [--cluster a100-80gb] [--reference PATH] [--json out.json]

Prints, per published configuration, the measured and predicted TFLOP/s per GPU and the error, the
median and max |error| (targets 5% and 10%), and the planner's own best layout with its predicted speedup
over the published one (target >= 1). The reference lives at ../shared/reference/megatron_a100_2021.csv
relative to the repository root.

With --activations it also compares the predicted saved-activation bytes of one layer with the bytes the
tensor-parallel issue's saved-tensor hooks measure (llmtrain.parallel.memory) on small CPU models.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmtrain.config import ConfigError
from llmtrain.planner.validation import format_results, summary, validate_megatron


def activation_check() -> str:
    """Predicted vs measured saved-activation bytes of one layer (tp=1, bf16, torch kernels on CPU)."""
    import torch

    from llmtrain.config.schema import ModelConfig
    from llmtrain.models import build
    from llmtrain.parallel.memory import measure_layer_bytes
    from llmtrain.planner import CostModel, Workload, load_cluster

    lines = ["arch   dropout  measured_bytes  predicted_bytes  ratio"]
    for arch, drop in (("gpt", 0.0), ("gpt", 0.1), ("llama", 0.0), ("ernie", 0.0)):
        kv = None if arch == "gpt" else 2
        cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=256, num_attention_heads=4, num_kv_heads=kv,
                          vocab_size=512, seq_length=128, hidden_dropout=drop, attention_dropout=drop,
                          kernels="torch")  # fmt: skip
        torch.manual_seed(0)
        model = build(cfg).to(torch.bfloat16).train()
        measured = measure_layer_bytes(model, 0, 2, cfg.seq_length)
        predicted = CostModel(
            Workload(cfg, 8, "bf16"), load_cluster("a100-80gb").view(1)
        ).activation_bytes_per_layer(1, 2, False, "none")
        lines.append(
            f"{arch:6s} {drop:7.1f}  {measured:14d}  {int(predicted):15d}  {predicted / measured:5.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the validation and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", default="a100-80gb", help="cluster YAML or preset (one for every row)")
    parser.add_argument("--reference", help="published table CSV (default ../shared/reference/...)")
    parser.add_argument("--json", help="also write the per-row results to this JSON file")
    parser.add_argument(
        "--activations", action="store_true", help="also check activation bytes (needs torch)"
    )
    args = parser.parse_args(argv)
    try:
        results = validate_megatron(args.cluster, args.reference)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_results(results))
    if args.activations:
        print(activation_check())
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
