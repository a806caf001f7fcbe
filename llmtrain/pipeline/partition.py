"""Which layers each pipeline stage holds (pure Python: the planner's memory and time models use it too)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from llmtrain.config.layout_rules import layer_plan_problem, pipeline_problem
from llmtrain.config.validate import raise_if_problem


def partition_layers(
    num_layers: int,
    num_stages: int,
    layer_costs: Sequence[float] | None = None,
    embed_cost: float = 0.0,
    head_cost: float = 0.0,
    sizes: Sequence[int] = (),
) -> list[range]:
    """Contiguous layer ranges, one per stage, each non-empty, minimising the most expensive stage.

    Without costs every layer costs 1 (an even split; earlier stages take the remainder). ``embed_cost``
    and ``head_cost`` are added to the first and last stage, so a heavy head pushes layers forward.
    ``sizes`` (parallel.stage_layers: layers per stage, e.g. a planner's choice) replaces the split.
    """
    raise_if_problem(pipeline_problem(num_layers, num_stages))
    if sizes:
        raise_if_problem(layer_plan_problem(num_layers, num_stages, (), sizes))
        starts = list(itertools.accumulate(sizes, initial=0))
        return [range(a, a + n) for a, n in zip(starts, sizes, strict=False)]
    if layer_costs is None:
        if embed_cost == head_cost == 0.0:
            base, extra = divmod(num_layers, num_stages)
            sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
            starts = [sum(sizes[:s]) for s in range(num_stages)]
            return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]
        layer_costs = [1.0] * num_layers
    if len(layer_costs) != num_layers:
        raise ValueError(
            f"partition_layers: {len(layer_costs)} layer costs for model.num_layers={num_layers}"
        )
    costs = list(map(float, layer_costs))
    # Dynamic programme over (stages used, layers placed): exact minimum of the maximum stage cost.
    inf = float("inf")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> float:
        extra = (embed_cost if s == 0 else 0.0) + (head_cost if s == num_stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for b in range(s, num_layers - (num_stages - s) + 1):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], stage_cost(s - 1, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds = [num_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
