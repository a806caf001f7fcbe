"""Per-layer coordinate descent against exhaustive enumeration on random problems small enough to enumerate.

Each problem: a random dense model of 4-6 layers (width, heads, sequence drawn), a random GPU count and
global batch on an H100 node, and a device memory drawn between what the best uniform layout needs with full
recomputation and without any, so that recomputing some layers and not others is what fits. The reference
enumerates every distinct plan the descents can reach (per_layer.enumerate_plans with each seed's settings
the descent holds: schedule, sequence parallelism, sharding); the gap is the descent's
step time over the reference's best, minus one.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, replace

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cluster.hardware import ClusterView
from llmtrain.planner.cost.layout import GIB, Workload
from llmtrain.planner.cost.model import CostModel
from llmtrain.planner.search.per_layer import PerLayerSearch, enumerate_plans, search_per_layer, seeds
from llmtrain.planner.search.uniform import build_space, plan, score


@dataclass
class Gap:
    """One problem's outcome."""

    problem: str
    descent: float
    exhaustive: float
    evaluated: int
    enumerated: int

    @property
    def gap(self) -> float:
        return self.descent / self.exhaustive - 1.0


def random_problem(rng: random.Random) -> tuple[Workload, ClusterView, str]:
    """A small random workload, a cluster view whose memory makes recomputation matter, and a name."""
    heads = rng.choice((8, 16, 32))
    model = ModelConfig(
        arch=rng.choice(("llama", "gpt")),
        num_layers=rng.randint(4, 6),
        hidden_size=heads * rng.choice((64, 128)),
        num_attention_heads=heads,
        vocab_size=32000,
        seq_length=rng.choice((2048, 4096, 8192)),
    )
    gpus = rng.choice((1, 2, 4))
    work = Workload(model, global_batch=gpus * rng.choice((1, 2, 4)))
    view = load_cluster("h100-80gb").view(gpus)
    need = {}
    for rc in ("full", "none"):
        best = plan(work, view, gpus, fixed={"recompute": rc}, simulate_top=False).ranked[0]
        need[rc] = best.memory["total"]
    lo, hi = sorted(need.values())
    capacity = rng.uniform(lo, hi) / GIB
    view = replace(view, device=replace(view.device, memory_gb=capacity))
    name = (
        f"{model.arch} L={model.num_layers} h={model.hidden_size} s={model.seq_length} gpus={gpus} "
        f"batch={work.global_batch} mem={capacity:.1f} GiB"
    )
    return work, view, name


def compare(work: Workload, view: ClusterView, name: str) -> Gap | None:
    """Descent from the best uniform layout against every plan enumerated; None when nothing fits."""
    try:
        uniform = plan(work, view, view.devices, simulate_top=False)
    except ConfigError:
        return None
    model = CostModel(work, view)
    space = build_space(model)
    found = search_per_layer(model, space, uniform.ranked)
    reference = PerLayerSearch(model, space)
    best, count = None, 0
    # The settings the descent holds (schedule, sequence parallelism, sharding) are each seed's.
    held = {
        replace(s.layout, tp=1, pp=1, dp=1, micro_batch=1, recompute="none"): s for s in seeds(uniform.ranked)
    }
    for start in held.values():
        for p in enumerate_plans(model, space, start.layout):
            est = reference.eval(p)
            count += 1
            if est is not None and (best is None or score(est) < score(best)):
                best = est
    if best is None or not best.fits or not found.best.fits:
        return None
    return Gap(name, found.best.step_time, best.step_time, found.evaluated, count)


def gap_statistics(problems: int, seed: int = 0) -> tuple[list[Gap], dict[str, float]]:
    """`problems` random problems where something fits: each Gap, and mean/max gap and exact-match share."""
    rng = random.Random(seed)
    gaps: list[Gap] = []
    while len(gaps) < problems:
        outcome = compare(*random_problem(rng))
        if outcome is not None:
            gaps.append(outcome)
    values = [g.gap for g in gaps]
    stats = {
        "problems": len(gaps),
        "mean_gap": statistics.fmean(values),
        "max_gap": max(values),
        "exact_share": sum(v <= 1e-9 for v in values) / len(values),
        "mean_evaluated": statistics.fmean(g.evaluated for g in gaps),
        "mean_enumerated": statistics.fmean(g.enumerated for g in gaps),
    }
    return gaps, stats
