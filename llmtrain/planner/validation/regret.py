"""The planner's pick measured against the layouts it rejected (issue 38 point 4): regret, rank correlation.

For a small job (REGRET_JOBS: the local validation's dense LLaMA and a Mixtral of the same size) and a process
count N, the layouts are those of the planner's own search space at N processes (build_space and
Space.layouts with the job's cost model, so "valid" is the planner's and the config validation's rule, each
counted once as the search canonicalises it). The pick is `parallel.auto`'s choice for the same job, N and
cluster (llmtrain.planner.auto.choose_layout, the function the trainer's plan_for_world calls). Each layout's
prediction is the cost model of exactly that layout with the software the run uses (run_software: the
reference ops on CPU) and the pipeline simulator on; its measurement is a short training run, done by the
caller (benchmarks/validate_planner.py --local --regret). The summary: regret = the pick's measured time over
the fastest measured time (target REGRET_TARGET), and Spearman of predicted vs measured.

The full space is hundreds of layouts per (job, N) (count_space), too many to train on a 2-core machine, so
the measured set is cut by MEASURED_RULE (measured_set), a rule that does not ask the planner which layouts
are good: every (tp, pp, dp, ep, schedule, ZeRO stage, sequence parallelism) of the space once, at one
micro-batch chosen by rule_micro_batch, without recompute, offload, hybrid sharding or once-a-step reduction;
plus the pick and every layout of the space that differs from the pick in one setting (its micro-batches,
recompute modes, sequence parallelism, schedules, sharding choices: the nearest rivals). Offload is left out
everywhere: the planner ranks it after every layout that fits (search.uniform.OFFLOAD_RANK), so it is never
the pick while anything fits, and it runs through DeepSpeed, which the trainer allows for dense models only.

Pure Python: launching the runs is the benchmark's job; `measure` is any function of a layout.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llmtrain.config.schema import JobConfig
from llmtrain.planner.auto import choose_layout, run_software
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.layout import Layout, Workload
from llmtrain.planner.cost.model import CostModel
from llmtrain.planner.search.uniform import Searcher, build_space
from llmtrain.planner.validation.local import LOCAL_CONFIG, LOCAL_MODEL_OVERRIDES, LocalPoint, spearman

REGRET_JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dense": (LOCAL_CONFIG, LOCAL_MODEL_OVERRIDES),
    "moe": (
        "configs/mixtral-small.yaml",
        (
            "model.num_experts=4",  # ep 1, 2, 4: every expert-parallel degree of 4 processes
            "train.global_batch_size=16",
            "train.precision=fp32",
        ),
    ),
}
"""The small jobs, (config, overrides): 4 layers x 256 hidden, sequences of 128, global batch 16, fp32."""

REGRET_PROCESSES = (2, 4)
REGRET_TARGET = 0.05
"""Issue 38 point 4: the pick's measured time at most 5% over the measured fastest."""

MEASURED_RULE = (
    "every (tp, pp, dp, ep, schedule, zero, sp) of the space at one micro-batch (pp=1: the whole per-replica "
    "batch; pp>1: the largest giving at least 2*pp micro-batches), recompute none, no offload, hybrid "
    "sharding or reduce=step; plus the pick and every layout one setting away from it; offload never"
)
"""measured_set's rule, as the report prints it."""


def rule_micro_batch(per_replica: int, pp: int, allowed: Iterable[int]) -> int:
    """The micro-batch the cut keeps: with pp=1 the whole per-replica batch (one micro-batch: the largest
    matmuls, no accumulation); with a pipeline the largest that still gives 2*pp micro-batches (the bubble at
    most a third of a 1F1B step), else the smallest allowed."""
    allowed = sorted(allowed)
    if pp == 1:
        return per_replica if per_replica in allowed else allowed[-1]
    deep = [b for b in allowed if per_replica // b >= 2 * pp]
    return deep[-1] if deep else allowed[0]


def space_layouts(model: CostModel) -> list[Layout]:
    """Every valid layout of the planner's search space for `model`'s job and devices, each once as the
    search counts it (Searcher.canonical), in the space's order."""
    space = build_space(model)
    searcher = Searcher(model, space)
    return list(dict.fromkeys(searcher.canonical(layout) for layout in space.layouts(model)))


SETTINGS = (
    ("tp", "pp", "dp", "cp", "cp_comm"),
    ("ep",),
    ("micro_batch",),
    ("schedule", "virtual_stages"),
    ("recompute", "layer_recompute", "stage_layers"),
    ("sequence_parallel",),
    ("zero_stage", "dp_shard", "offload", "grad_reduce"),
)
"""The settings of a layout, as one moves them: the grid point (dp follows tp, pp, cp), expert parallelism,
the micro-batch, the schedule with its virtual stages, recompute, sequence parallelism, the sharding."""


def settings_apart(a: Layout, b: Layout) -> int:
    """In how many SETTINGS `a` and `b` differ."""
    return sum(any(getattr(a, name) != getattr(b, name) for name in group) for group in SETTINGS)


def measured_set(layouts: Sequence[Layout], pick: Layout, global_batch: int) -> list[Layout]:
    """The layouts MEASURED_RULE keeps of `layouts` (the space), the pick first."""
    kept = [pick]
    base = [lay for lay in layouts if lay.offload == "none"]
    allowed: dict[tuple, list[int]] = {}
    for lay in base:
        allowed.setdefault((lay.tp, lay.pp, lay.dp), []).append(lay.micro_batch)
    for lay in base:
        plain = lay.recompute == "none" and lay.dp_shard is None and lay.grad_reduce == "microbatch"
        mb = rule_micro_batch(global_batch // lay.dp, lay.pp, allowed[(lay.tp, lay.pp, lay.dp)])
        if (plain and lay.micro_batch == mb) or settings_apart(lay, pick) == 1:
            kept.append(lay)
    return list(dict.fromkeys(kept))


@dataclass
class RegretResult:
    """One (job, N): the pick, the measured points, how many layouts the space and the set have."""

    job: str
    processes: int
    pick: Layout
    points: list[LocalPoint]
    space: int
    seconds: float = 0.0

    def point(self, layout: Layout) -> LocalPoint:
        return next(p for p in self.points if p.layout == layout)

    @property
    def fastest(self) -> LocalPoint:
        return min(self.points, key=lambda p: p.measured)

    @property
    def regret(self) -> float:
        """The pick's measured time over the fastest measured (1: the pick is the fastest)."""
        return self.point(self.pick).measured / self.fastest.measured

    @property
    def meets(self) -> bool:
        return self.regret <= 1 + REGRET_TARGET

    @property
    def spearman(self) -> float:
        """Rank correlation of predicted vs measured (nan under two points)."""
        if len(self.points) < 2:
            return math.nan
        return spearman([p.predicted for p in self.points], [p.measured for p in self.points])

    def record(self) -> dict:
        """The result for --json."""
        return {
            "job": self.job,
            "processes": self.processes,
            "space_layouts": self.space,
            "measured_layouts": len(self.points),
            "pick": self.pick.short(),
            "pick_measured_s": self.point(self.pick).measured,
            "fastest": self.fastest.layout.short(),
            "fastest_measured_s": self.fastest.measured,
            "regret": self.regret,
            "meets": self.meets,
            "spearman": self.spearman,
            "seconds": self.seconds,
            "rows": [
                {"layout": p.layout.short(), "predicted_s": p.predicted, "measured_s": p.measured}
                for p in self.points
            ],
        }


def regret_check(
    name: str,
    job: JobConfig,
    cluster: Cluster,
    processes: int,
    measure: Callable[[Layout], float],
    limit: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> RegretResult:
    """Pick, predict and measure the set of `job` at `processes` (the first `limit` of it, the pick first,
    when given)."""
    start = time.perf_counter()
    software = run_software(job)
    model = CostModel(Workload.from_job(job), cluster.view(processes), software)
    everything = space_layouts(model)
    pick = choose_layout(job, processes, cluster)[0].layout
    chosen = measured_set(everything, pick, job.train.global_batch_size)[:limit]
    points = []
    for i, layout in enumerate(chosen, 1):
        predicted = model.evaluate(layout, use_simulator=True).step_time
        measured = measure(layout)
        points.append(LocalPoint(layout, predicted, measured))
        if progress:
            progress(
                f"[regret {name} N={processes} {i}/{len(chosen)}] {layout.short()}: predicted "
                f"{predicted:.4f} s, measured {measured:.4f} s, {time.perf_counter() - start:.0f} s so far"
            )
    return RegretResult(name, processes, pick, points, len(everything), time.perf_counter() - start)


def format_regret(results: Sequence[RegretResult]) -> str:
    """Per (job, N): the measured layouts, then the regret line and the Spearman line."""
    lines = [f"regret check: measured set = {MEASURED_RULE}"]
    for r in results:
        lines.append(f"{r.job} at {r.processes} processes: {len(r.points)} of the space's {r.space} layouts")
        for p in sorted(r.points, key=lambda p: p.measured):
            mark = "pick" if p.layout == r.pick else ""
            lines.append(f"  {mark:4s} {p.layout.short():<62} {p.predicted:8.4f} {p.measured:8.4f}")
        verdict = "meets" if r.meets else "misses"
        pick_s = r.point(r.pick).measured
        lines.append(
            f"regret of parallel.auto's pick ({r.job}, {r.processes} processes): {r.regret:.3f} "
            f"({verdict} <= {1 + REGRET_TARGET:.2f}): pick {r.pick.short()} {pick_s:.4f} s, "
            f"fastest {r.fastest.layout.short()} {r.fastest.measured:.4f} s"
        )
        lines.append(
            f"Spearman of predicted vs measured ({r.job}, {r.processes} processes): {r.spearman:+.3f} over "
            f"{len(r.points)} layouts, measured in {r.seconds:.0f} s"
        )
    if results:
        lines.append(
            f"regret median {statistics.median(r.regret for r in results):.3f}, max "
            f"{max(r.regret for r in results):.3f} over {len(results)} (job, processes)"
        )
    return "\n".join(lines)


def stderr_progress(line: str) -> None:
    """A progress line on stderr."""
    print(line, file=sys.stderr, flush=True)
