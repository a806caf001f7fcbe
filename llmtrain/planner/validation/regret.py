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

One run per layout cannot call a regret on a shared machine (a layout's runs spread by up to 20% there), and
repeating every layout costs hours, so a confirmation round follows the first pass (confirm_contenders): the
contenders, the pick and every layout whose first run is within REGRET_BAND of the fastest first run, are
measured `confirm` more times round-robin, and each counts the fastest of its runs.

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
from dataclasses import dataclass, field

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

REGRET_BAND = 1.30
"""The contenders' band: a layout whose first run took more than this factor times the fastest first run is
not measured again. Other load only slows a run, so a run's time is an upper bound of the layout's own; and
on the shared 2-core machine one layout's runs spread by up to 20% (docs/planner.md, the regret check), so a
run is at most 1.2 times its layout's own time. A layout measured m > 1.30 * F (F: the fastest first run) has
its own time above m / 1.2 > 1.08 * F, slower than a time the fastest layout has already run: it cannot be the
fastest, nor come within the 5% target of it, and a second run of it changes neither side of the regret. The
margin over 1.2 covers a spread a little wider than the one measured. The confirmed runs of 2026-11-28 on the
idle machine spread up to 1.26 (the MoE pick: 0.954 to 1.198 s), which leaves a layout outside the band
above 1.03 * F only: the 5% part of the argument no longer holds at that spread (docs/planner.md)."""

REGRET_CONFIRM = 2
"""Runs of each contender after its first (3 in all, the --local-repeats the round-robin re-measurement that
showed the 20% spread used), round-robin: one run of each contender per round, so a slow period of the
machine hits one run of several contenders rather than every run of one."""

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
    runs: dict[Layout, list[float]] = field(default_factory=dict)
    """Every measured time of a layout, first run first (a point's `measured` is their minimum); a layout
    not listed was measured once."""
    band: float = REGRET_BAND
    confirm: int = 0

    def point(self, layout: Layout) -> LocalPoint:
        return next(p for p in self.points if p.layout == layout)

    def runs_of(self, point: LocalPoint) -> list[float]:
        """The point's measured times, first run first."""
        return self.runs.get(point.layout, [point.measured])

    @property
    def confirmed(self) -> list[LocalPoint]:
        """The points measured more than once (the confirmation round's contenders)."""
        return [p for p in self.points if len(self.runs_of(p)) > 1]

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
            "band": self.band,
            "confirm": self.confirm,
            "confirmed_layouts": len(self.confirmed),
            "rows": [
                {
                    "layout": p.layout.short(),
                    "predicted_s": p.predicted,
                    "measured_s": p.measured,
                    "confirmed": len(self.runs_of(p)) > 1,
                    "runs_s": self.runs_of(p),
                }
                for p in self.points
            ],
        }


def confirm_contenders(
    first: dict[Layout, float],
    pick: Layout,
    measure: Callable[[Layout], float],
    band: float = REGRET_BAND,
    confirm: int = REGRET_CONFIRM,
    progress: Callable[[Layout, str, float], None] | None = None,
) -> dict[Layout, list[float]]:
    """The confirmation round: the pick and every layout whose `first` time is within `band` of the fastest,
    in `first`'s order, each measured `confirm` more times, one run of each per round. Returns every
    contender's times, its first run first; `progress(layout, "round r/confirm, i/contenders", time)` per
    run."""
    fastest = min(first.values())
    contenders = [lay for lay, t in first.items() if lay == pick or t <= band * fastest]
    runs = {lay: [first[lay]] for lay in contenders}
    for round_ in range(1, confirm + 1):
        for i, layout in enumerate(contenders, 1):
            runs[layout].append(measure(layout))
            if progress:
                progress(layout, f"round {round_}/{confirm}, {i}/{len(contenders)}", runs[layout][-1])
    return runs


def regret_check(
    name: str,
    job: JobConfig,
    cluster: Cluster,
    processes: int,
    measure: Callable[[Layout], float],
    limit: int | None = None,
    progress: Callable[[str], None] | None = None,
    band: float = REGRET_BAND,
    confirm: int = REGRET_CONFIRM,
) -> RegretResult:
    """Pick, predict and measure the set of `job` at `processes` (the first `limit` of it, the pick first,
    when given), then measure the contenders `confirm` more times (confirm_contenders); each layout counts
    the fastest of its runs."""
    start = time.perf_counter()
    software = run_software(job)
    model = CostModel(Workload.from_job(job), cluster.view(processes), software)
    everything = space_layouts(model)
    pick = choose_layout(job, processes, cluster)[0].layout
    chosen = measured_set(everything, pick, job.train.global_batch_size)[:limit]
    predicted, first = {}, {}
    for i, layout in enumerate(chosen, 1):
        predicted[layout] = model.evaluate(layout, use_simulator=True).step_time
        first[layout] = measure(layout)
        if progress:
            progress(
                f"[regret {name} N={processes} {i}/{len(chosen)}] {layout.short()}: predicted "
                f"{predicted[layout]:.4f} s, measured {first[layout]:.4f} s, "
                f"{time.perf_counter() - start:.0f} s so far"
            )

    def confirm_line(layout: Layout, where: str, seconds: float) -> None:
        if progress:
            progress(
                f"[regret {name} N={processes} confirm {where}] {layout.short()}: measured {seconds:.4f} s "
                f"(first {first[layout]:.4f} s), {time.perf_counter() - start:.0f} s so far"
            )

    runs = confirm_contenders(first, pick, measure, band, confirm, confirm_line)
    points = [LocalPoint(lay, predicted[lay], min(runs.get(lay, [first[lay]]))) for lay in chosen]
    return RegretResult(
        name, processes, pick, points, len(everything), time.perf_counter() - start, runs, band, confirm
    )


def format_regret(results: Sequence[RegretResult]) -> str:
    """Per (job, N): the measured layouts, then the regret line and the Spearman line."""
    lines = [f"regret check: measured set = {MEASURED_RULE}"]
    for r in results:
        lines.append(f"{r.job} at {r.processes} processes: {len(r.points)} of the space's {r.space} layouts")
        lines.append(
            f"  confirmed: {len(r.confirmed)} contenders (the pick and every layout whose first run is "
            f"within {r.band:.2f}x of the fastest) measured {r.confirm} more times round-robin, each its "
            "fastest run"
            if r.confirm
            else "  not confirmed: one run per layout (--regret-confirm 0)"
        )
        lines.append(f"  {'':4s} {'layout':<62} {'predicted':>9} {'measured':>9}  runs")
        for p in sorted(r.points, key=lambda p: p.measured):
            mark = "pick" if p.layout == r.pick else ""
            runs = len(r.runs_of(p))
            confirmed = " confirmed" if runs > 1 else ""
            times = f"{p.predicted:9.4f} {p.measured:9.4f}"
            lines.append(f"  {mark:4s} {p.layout.short():<62} {times}  {runs:4d}{confirmed}")
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
