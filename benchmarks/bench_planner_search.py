"""Per-layer planner search: its gap to exhaustive enumeration, and its time on a 1T-parameter model.

    python benchmarks/bench_planner_search.py [--problems 100] [--seed 0] [--repeats 3] [--gpus 3072]

Prints the mean and max relative step-time gap of the per-layer coordinate descent (llmtrain.planner.
per_layer) to the best plan found by enumerating every distinct plan, and the share of exact matches, over
random small problems (llmtrain.planner.validation.per_layer), then the time of the uniform search and of
the per-layer search for a 1T-parameter GPT (gpt3-175b's config with 128 layers of width 25600) on
--gpus H100s, the fastest of --repeats runs, at 2k and 8k tokens (where recomputation matters).
"""

from __future__ import annotations

import argparse
import time

from llmtrain.config import load
from llmtrain.planner import CostModel, Workload, load_cluster, plan
from llmtrain.planner.cost.flops import num_parameters
from llmtrain.planner.search.per_layer import search_per_layer
from llmtrain.planner.search.uniform import build_space
from llmtrain.planner.validation.per_layer import gap_statistics

ONE_T = ["model.num_layers=128", "model.hidden_size=25600", "model.num_attention_heads=160"]


def trillion(gpus: int, seq: int, repeats: int) -> None:
    """Time the uniform and the per-layer search of the 1T model, the fastest of `repeats` (fresh caches)."""
    job = load("configs/gpt3-175b.yaml", [*ONE_T, f"model.seq_length={seq}"])
    work = Workload.from_job(job)
    cluster = load_cluster("h100-80gb")
    uniform_s, per_layer_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan(work, cluster, gpus)
        uniform_s.append(time.perf_counter() - t0)
        model = CostModel(work, cluster.view(gpus))  # fresh per-layer caches
        found = search_per_layer(model, build_space(model), result.ranked)
        per_layer_s.append(found.seconds)
    print(
        f"{num_parameters(job.model) / 1e12:.2f}T params, {gpus} x H100, batch {work.global_batch} x {seq}: "
        f"uniform search {min(uniform_s):.3f} s, per-layer search {min(per_layer_s):.3f} s "
        f"({found.evaluated} plans), gain {100 * found.gain:.2f}%\n  {found.best.layout.short()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=100, help="random problems compared with enumeration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of the 1T search (fastest shown)")
    ap.add_argument("--gpus", type=int, default=3072)
    args = ap.parse_args()
    t0 = time.perf_counter()
    gaps, stats = gap_statistics(args.problems, args.seed)
    print(
        f"per-layer descent vs exhaustive enumeration, {stats['problems']} random problems "
        f"({time.perf_counter() - t0:.1f} s): mean gap {100 * stats['mean_gap']:.3f}%, "
        f"max gap {100 * stats['max_gap']:.2f}%, exact {100 * stats['exact_share']:.0f}%; "
        f"plans evaluated {stats['mean_evaluated']:.0f} vs enumerated {stats['mean_enumerated']:.0f} (means)"
    )
    for g in gaps:
        if g.gap > 1e-9:
            print(f"  missed by {100 * g.gap:.2f}%: {g.problem}")
    for seq in (2048, 8192):
        trillion(args.gpus, seq, args.repeats)


if __name__ == "__main__":
    main()
