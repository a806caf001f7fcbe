"""Per-layer search: recomputation per layer and layers per pipeline chunk, with the global degrees.

AutoDDL-style coordinate descent (Chen et al. 2023) from the best uniform layout: each coordinate in turn is
set to its best value with the others held, sweeping until no coordinate improves. The coordinates:
- each chunk's recompute: how many of its layers run full, selective or no recomputation (a line search
  over moving k layers from one mode to another);
- each boundary between adjacent chunks: one layer (of any mode) moved across it;
- the global degrees: tp and pp (dp follows; the layers are re-split as the trainer would, keeping each
  layer's mode) and the micro-batch size, over the values the uniform search allowed.
The cost model sees a chunk's layers only through how many run each mode (time: per-rank sums; memory: the
chunk's activation sum), so a plan is kept in a canonical form (per chunk: full, then selective, then none)
and `enumerate_plans` can enumerate every distinct plan of a small problem as the exact reference.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from llmtrain.config.validate import pipeline_problem
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.cost.model import CostModel, Estimate
from llmtrain.planner.search.uniform import Space, score

MODES = ("full", "selective", "none")
"""Recompute modes, in the order a chunk's layers are kept in (canonical form)."""
SEEDS = 4
"""Descents, from the best uniform layouts of distinct (tp, pp, micro-batch)."""
Counts = tuple[int, int, int]
"""Layers of one chunk running each of MODES."""


@dataclass(frozen=True)
class Plan:
    """A layout's global settings with its per-chunk recompute counts (the search's state)."""

    base: Layout
    """Global degrees and settings (recompute none, no per-layer fields: the chunks say those)."""
    chunks: tuple[Counts, ...]

    def layout(self) -> Layout:
        """The Layout the cost model evaluates: uniform fields where the plan is uniform."""
        modes = tuple(
            itertools.chain.from_iterable(
                itertools.repeat(m, n) for c in self.chunks for m, n in zip(MODES, c, strict=True)
            )
        )
        uniform = len({m for c in self.chunks for m, n in zip(MODES, c, strict=True) if n}) == 1
        return replace(
            self.base,
            recompute=modes[0] if uniform else "none",
            layer_recompute=None if uniform else modes,
            stage_layers=tuple(sum(c) for c in self.chunks),
        )


def plan_of(layout: Layout, model: CostModel) -> Plan:
    """The canonical plan of a layout: its chunks' mode counts (its own split, else the trainer's)."""
    stages = model.chunk_layers(layout)
    modes = layout.layer_modes(model.w.model.num_layers)
    starts = itertools.accumulate(stages, initial=0)
    chunks = tuple(
        tuple(modes[a : a + n].count(m) for m in MODES) for a, n in zip(starts, stages, strict=False)
    )
    base = replace(layout, recompute="none", layer_recompute=None, stage_layers=None)
    return Plan(base, chunks)  # type: ignore[arg-type]


def _resplit(plan: Plan, base: Layout, model: CostModel) -> Plan:
    """`plan`'s layers, each keeping its mode, split over `base`'s chunks as the trainer splits them."""
    layers = plan.layout().layer_modes(model.w.model.num_layers)
    return plan_of(replace(base, layer_recompute=layers, stage_layers=None), model)


@dataclass
class PerLayerResult:
    """The best per-layer plan against the best uniform layout it started from."""

    uniform: Estimate
    best: Estimate
    evaluated: int
    seconds: float

    @property
    def gain(self) -> float:
        """Relative step-time reduction over the uniform layout (0.05: 5% faster)."""
        return 1.0 - self.best.step_time / self.uniform.step_time

    def as_dict(self) -> dict:
        """JSON-ready: both estimates, the per-layer choices (empty lists: uniform), the gain, the cost."""
        lay = self.best.layout
        return {
            "uniform": self.uniform.as_dict(),
            "best": self.best.as_dict(),
            "recompute_layers": list(lay.layer_recompute or ()),
            "stage_layers": list(lay.stage_layers or ()),
            "gain": self.gain,
            "evaluated": self.evaluated,
            "seconds": self.seconds,
        }

    def format(self) -> str:
        """The per-layer choice against the uniform one, as text."""
        u, b = self.uniform, self.best
        lines = [
            f"per-layer search (coordinate descent, {self.evaluated} plans in {self.seconds:.3f} s):",
            f"  best uniform  {u.step_time:9.3f} s  {u.memory_gb:6.1f} GiB  {u.layout.short()}",
            f"  per-layer     {b.step_time:9.3f} s  {b.memory_gb:6.1f} GiB  {b.layout.short()}",
            f"  gain {100 * self.gain:.2f}% step time",
        ]
        if b.layout.layer_recompute:
            spans, start = [], 0
            for mode, group in itertools.groupby(b.layout.layer_recompute):
                n = len(list(group))
                spans.append(f"{start}-{start + n - 1} {mode}" if n > 1 else f"{start} {mode}")
                start += n
            lines.append("  recompute per layer: " + ", ".join(spans))
        if b.layout.stage_layers:
            stages = b.layout.stage_layers
            lines.append(f"  layers per chunk, {len(stages)} in order: " + " ".join(map(str, stages)))
        return "\n".join(lines)


class PerLayerSearch:
    """Coordinate descent over per-layer plans of one workload, with a cache of evaluated layouts."""

    def __init__(self, model: CostModel, space: Space) -> None:
        self.model = model
        self.space = space
        self.cache: dict[Plan, Estimate | None] = {}

    def eval(self, plan: Plan) -> Estimate | None:
        """The plan's estimate, None if its layout cannot run."""
        if plan not in self.cache:
            layout = plan.layout()
            bad = self.model.invalid_reason(layout)
            self.cache[plan] = None if bad else self.model.evaluate(layout)
        return self.cache[plan]

    def _score(self, plan: Plan) -> float:
        est = self.eval(plan)
        return float("inf") if est is None else score(est)

    def _recompute_moves(self, plan: Plan, c: int) -> Iterator[Plan]:
        """Chunk c with k of its layers switched from one mode to another, per pair of modes the best k:
        when the plan fits, less recomputation only adds memory and saves time, so the most layers that still
        fit; when it does not, more only saves memory and adds time, so the fewest that fit (else all). Both
        are monotone in k: a bisection finds them."""
        counts, est = plan.chunks[c], self.eval(plan)
        fits = est is not None and est.fits
        for a, b in itertools.permutations(range(len(MODES)), 2):
            if (a < b) != fits or not counts[a]:
                continue

            def moved(k: int, a: int = a, b: int = b) -> Plan:
                new = list(counts)
                new[a], new[b] = new[a] - k, new[b] + k
                return replace(plan, chunks=plan.chunks[:c] + (tuple(new),) + plan.chunks[c + 1 :])  # type: ignore[arg-type]

            def ok(k: int) -> bool:
                e = self.eval(moved(k))
                return e is not None and e.fits

            if fits:  # the largest k that fits (k = 0 does)
                lo, hi = 0, counts[a]
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
                if lo:
                    yield moved(lo)
            else:  # the smallest k that fits, or all of them
                lo, hi = 1, counts[a]
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
                yield moved(lo)

    def _boundary_moves(self, plan: Plan, c: int) -> Iterator[Plan]:
        """One layer of each mode moved across the boundary between chunks c and c + 1, either way."""
        for src, dst in ((c, c + 1), (c + 1, c)):
            if sum(plan.chunks[src]) == 1:
                continue  # every chunk keeps a layer
            for m in range(len(MODES)):
                if plan.chunks[src][m]:
                    chunks = [list(x) for x in plan.chunks]
                    chunks[src][m] -= 1
                    chunks[dst][m] += 1
                    yield replace(plan, chunks=tuple(tuple(x) for x in chunks))  # type: ignore[arg-type]

    def _global_moves(self, plan: Plan) -> Iterator[Plan]:
        """Every (tp, pp) of the space that allows the plan's cp (dp follows, layers re-split) and every
        micro-batch size."""
        s, gpus, cur = self.space, self.model.c.devices, plan.base
        for tp, pp in s.tp_pp:
            if pipeline_problem(self.model.w.model.num_layers, pp, cur.virtual_stages, cur.schedule):
                continue
            if (cur.cp, cur.cp_comm) not in s.contexts[(tp, pp)]:
                continue
            dp = gpus // (tp * pp * cur.cp)
            mb = min(s.micro_batches[dp], key=lambda b: (abs(b - cur.micro_batch), b))
            yield _resplit(plan, replace(cur, tp=tp, pp=pp, dp=dp, micro_batch=mb), self.model)
        for b in s.micro_batches[cur.dp]:
            yield replace(plan, base=replace(cur, micro_batch=b))

    def _best(self, plan: Plan, moves: Iterable[Plan]) -> tuple[Plan, bool]:
        best, best_score = plan, self._score(plan)
        for cand in moves:
            cand_score = self._score(cand)
            if cand_score < best_score * (1 - 1e-12):
                best, best_score = cand, cand_score
        return best, best is not plan

    def descend(self, start: Layout) -> Plan:
        """Coordinate descent from `start` until a whole sweep improves nothing."""
        plan = plan_of(start, self.model)
        improved = True
        while improved:
            improved = False
            c = 0
            while c < len(plan.chunks):
                plan, changed = self._best(plan, self._recompute_moves(plan, c))
                improved |= changed
                c += 1
            c = 0
            while c < len(plan.chunks) - 1:
                plan, changed = self._best(plan, self._boundary_moves(plan, c))
                improved |= changed
                c += 1
            # A (tp, pp) or micro-batch change often pays only with the recomputation re-chosen for it:
            # each global move is judged with its chunks' recomputation settled first.
            plan, changed = self._best(plan, map(self._settled, self._global_moves(plan)))
            improved |= changed
        return plan

    def _settled(self, plan: Plan) -> Plan:
        """The plan after one pass of the best recomputation move of each chunk."""
        for c in range(len(plan.chunks)):
            plan, _ = self._best(plan, self._recompute_moves(plan, c))
        return plan


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _mode_counts(n: int) -> list[Counts]:
    return [(f, s, n - f - s) for f in range(n + 1) for s in range(n + 1 - f)]


def enumerate_plans(model: CostModel, space: Space, start: Layout) -> Iterator[Plan]:
    """Every distinct plan the descent from `start` can reach: each (tp, pp) and micro-batch of the space,
    each split of the layers over the chunks, each chunk's mode counts (the rest of `start` fixed)."""
    gpus, layers = model.c.devices, model.w.model.num_layers
    for tp, pp in space.tp_pp:
        # The descent's own rule for (tp, pp) moves: a layout the schedule cannot run is not a plan.
        if pipeline_problem(layers, pp, start.virtual_stages, start.schedule):
            continue
        if (start.cp, start.cp_comm) not in space.contexts[(tp, pp)]:
            continue
        dp = gpus // (tp * pp * start.cp)
        chunks = pp * start.virtual_stages
        for mb in space.micro_batches[dp]:
            base = replace(start, tp=tp, pp=pp, dp=dp, micro_batch=mb)
            for split in _compositions(layers, chunks):
                for counts in itertools.product(*(_mode_counts(n) for n in split)):
                    yield Plan(base, counts)


def seeds(ranked: Sequence[Estimate], count: int = SEEDS) -> list[Estimate]:
    """The starts of the descents: the first `count` fitting estimates of `ranked` (best first) with distinct
    (tp, pp, micro-batch); the best one when none fits."""
    starts: dict[tuple[int, int, int], Estimate] = {}
    for est in ranked:
        key = (est.layout.tp, est.layout.pp, est.layout.micro_batch)
        if est.fits and key not in starts:
            starts[key] = est
            if len(starts) == count:
                break
    return list(starts.values()) or [ranked[0]]


def search_per_layer(
    model: CostModel, space: Space, ranked: Sequence[Estimate], count: int = SEEDS
) -> PerLayerResult:
    """Per-layer coordinate descent from the best uniform layouts of `ranked` (search.uniform.plan's
    ranking, best first): one descent from each of `seeds`, since a change of tp, pp or micro-batch together
    with the recomputation re-chosen can beat each alone (the restarts of AutoDDL)."""
    t0 = time.perf_counter()
    search = PerLayerSearch(model, space)
    best = ranked[0]
    for start in seeds(ranked, count):
        found = search.eval(search.descend(start.layout))
        if found is not None and score(found) < score(best):
            best = found
    evaluated = sum(e is not None for e in search.cache.values())
    return PerLayerResult(ranked[0], best, evaluated, time.perf_counter() - t0)
