"""Pipeline step time and in-flight micro-batches: the pipeline simulator, or its closed forms.

The pipeline issue's simulator (``llmtrain.pipeline.simulator``) replays a schedule's actions, so the planner
and the executor agree on what a schedule costs. Replaying is linear in ``pp * m * v`` actions, too slow
for a search over thousands of layouts with hundreds of micro-batches, so the search uses closed forms that
reproduce the simulator exactly for uniform per-chunk costs (tests/planner/test_pipeline_time.py checks
them against the simulator on a grid of shapes), with the heaviest rank setting the steady state when
stages differ (first stage: embeddings; last: logits and loss). The final ranking re-times small shapes
with the simulator itself (per-(rank, chunk) cost tables, cached per shape and costs).

Closed forms with per-chunk forward f, backward b (= input grad I + weight grad W), send latency c,
p ranks, m micro-batches, v chunks per rank:
    gpipe             (m + p - 1)(f + b) + 2(p - 1) c
    1f1b              (m + p - 1)(f + b) + (2(p - 1) + 2(k - floor(k / p))) c,  k = max(m - 2, 0)
    interleaved_1f1b  (m v + p - 1)(f + b) + 2(p v - 1) c                     (m >= p)
    zb_h1             m (f + b) + (p - 1)(f + I - W) + 4(p - 1) c        (m > p, W <= I, c <= f / 5)
    zb_v, dualpipe_v, interleaved_zb  m v (f + b) + (p - 1)(f + b - 2 W) + 4(p - 1) c    (approximate)
interleaved_1f1b needs m to be a multiple of p (Megatron's rule, which the planner enforces). zb_h1 shapes
outside that range, and the V-shaped and interleaved zero-bubble schedules always, are replayed with the
slowest rank's costs (normalised and rounded, so similar layouts share a replay) while p * m * v <=
SIMULATE_MAX_ACTIONS; beyond it the closed form is an approximation (exact for f = I = W and c = 0; within
5% of the simulator on tests/planner/test_pipeline_time.py's grid otherwise).

Memory of those schedules comes from their action lists (``held_and_owed``, replayed over at most
``PEAK_MICROBATCHES`` pp micro-batches: their warm-ups set the peaks): the (micro-batch, chunk) pairs whose
activations a rank holds (forward run, input gradient not yet) and those whose weight gradient it still
owes (the stash of the linear layers' inputs and output gradients a split backward keeps).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from llmtrain.pipeline.schedules import Schedule, build_schedule
from llmtrain.pipeline.simulator import held_and_owed, simulate

SIMULATE_MAX_ACTIONS = 1024
"""Re-time with the simulator when pp * micro-batches * virtual stages is at most this."""
REPLAYED = ("zb_v", "dualpipe_v", "interleaved_zb")
"""Schedules whose peaks come from their action lists and whose times from the simulator when affordable."""
PEAK_MICROBATCHES = 3
"""Peaks of REPLAYED schedules are read off min(m, this * pp) micro-batches (more change nothing)."""


@functools.lru_cache(maxsize=256)
def _checked_schedule(schedule: str, pp: int, m: int, v: int) -> Schedule:
    """One schedule, built and replayed once with unit costs (which checks it): a search replays it with
    the costs of many layouts."""
    sched = build_schedule(schedule, pp, m, v)
    simulate(sched, 1.0, 1.0)
    return sched


@functools.lru_cache(maxsize=1024)
def replayed_peaks(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, the most (micro-batch, chunk) pairs with activations held, and with weight gradients owed,
    in ``schedule``'s own action lists."""
    return held_and_owed(build_schedule(schedule, pp, min(m, PEAK_MICROBATCHES * pp), v))


@dataclass(frozen=True)
class PipelineTime:
    """Step time of the pipeline part of a step and the activations it keeps."""

    step_time: float
    busy: float
    """Compute time of the busiest rank (the ideal, bubble-free pipeline time)."""
    peak_inflight: int
    """Most (micro-batch, chunk) pairs with activations held on the rank holding most (rank 0)."""
    simulated: bool

    @property
    def bubble_fraction(self) -> float:
        """Share of the step the busiest rank is idle (pipeline fill/drain and transfers)."""
        return 1.0 - self.busy / self.step_time if self.step_time > 0 else 0.0


def peak_inflight_closed(schedule: str, pp: int, m: int, v: int, rank: int = 0) -> int:
    """Peak (micro-batch, chunk) pairs held by pipeline rank `rank`, as the schedule generators make them."""
    if schedule == "gpipe":
        return m
    if schedule in REPLAYED and pp > 1:
        return replayed_peaks(schedule, pp, m, v)[0][rank]
    if schedule == "interleaved_1f1b" and v > 1:
        return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
    return min(pp - rank, m)


def closed_form(
    schedule: str,
    pp: int,
    m: int,
    v: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight_grad: Sequence[float] | None,
    p2p: float,
) -> float:
    """Closed-form step time; `forward`/`backward`/`weight_grad` are per-rank costs of ONE chunk. Exact for
    uniform costs; otherwise the slowest rank sets the steady state and every rank's fill/drain is summed."""
    fb = [f + b for f, b in zip(forward, backward, strict=True)]
    fill, steady = sum(fb) / pp, max(fb)
    p = pp
    if p == 1:
        return m * v * steady
    if schedule == "gpipe":
        return (m - 1) * steady + p * fill + 2 * (p - 1) * p2p
    if schedule == "interleaved_1f1b" and v > 1:
        return (m * v - 1) * steady + p * fill + 2 * (p * v - 1) * p2p
    if schedule == "zb_h1" or schedule in REPLAYED:
        w = weight_grad if weight_grad is not None else [b / 2 for b in backward]
        tail = max(f + b - 2 * ww for f, b, ww in zip(forward, backward, w, strict=True))
        return m * v * steady + (p - 1) * tail + 4 * (p - 1) * p2p
    k = max(m - 2, 0)  # every micro-batch after the second waits a round trip, except one in each p
    return (m - 1) * steady + p * fill + (2 * (p - 1) + 2 * (k - k // p)) * p2p


def _needs_simulation(schedule: str, pp: int, m: int, v: int, slow_link: bool) -> bool:
    """Shapes the closed forms miss: zb_h1 with at most pp micro-batches or transfers longer than a fifth
    of a forward, and the REPLAYED schedules (while a replay stays affordable)."""
    if pp == 1 or pp * m * v > SIMULATE_MAX_ACTIONS:
        return False
    return schedule in REPLAYED or (schedule == "zb_h1" and (m <= pp or slow_link))


@functools.lru_cache(maxsize=4096)
def _simulated_uniform(
    schedule: str, pp: int, m: int, v: int, f: float, w: float, c: float
) -> tuple[float, int]:
    """Simulated step time for per-chunk costs forward f, backward 1 - f, weight-grad w, latency c (units of
    f + b, rounded by the caller so that similar layouts share one replay)."""
    return _simulated(schedule, pp, m, v, (f,) * pp, (1.0 - f,) * pp, (w,) * pp, c)


@functools.lru_cache(maxsize=4096)
def _simulated(
    schedule: str,
    pp: int,
    m: int,
    v: int,
    forward: tuple[float, ...],
    backward: tuple[float, ...],
    weight_grad: tuple[float, ...] | None,
    p2p: float,
) -> tuple[float, int]:
    sched = _checked_schedule(schedule, pp, m, v)
    table = lambda costs: [[c] * v for c in costs]  # noqa: E731 - every chunk of a rank costs the same
    result = simulate(
        sched,
        table(forward),
        table(backward),
        table(weight_grad) if weight_grad is not None else None,
        p2p,
        checked=True,
    )
    return result.step_time, result.peak_inflight[0]


def pipeline_time(
    schedule: str,
    pp: int,
    m: int,
    v: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight_grad: Sequence[float] | None = None,
    p2p: float = 0.0,
    use_simulator: bool = False,
) -> PipelineTime:
    """Pipeline time for per-rank, per-chunk costs; the simulator when asked (and the shape is small) or when
    no closed form applies, else the closed form."""
    busy = m * v * max(f + b for f, b in zip(forward, backward, strict=True))
    small = pp * m * v <= SIMULATE_MAX_ACTIONS
    if pp > 1 and use_simulator and small:
        step, inflight = _simulated(
            schedule,
            pp,
            m,
            v,
            tuple(forward),
            tuple(backward),
            tuple(weight_grad) if weight_grad is not None else None,
            p2p,
        )
        if schedule in REPLAYED:  # activations until the input gradient; the W stash apart (memory)
            inflight = peak_inflight_closed(schedule, pp, m, v)
        return PipelineTime(step, busy, inflight, True)
    if _needs_simulation(schedule, pp, m, v, p2p > 0.2 * min(forward)):
        # No closed form: replay once per shape with the slowest rank's costs, normalised and rounded.
        k = max(range(pp), key=lambda r: forward[r] + backward[r])
        unit = forward[k] + backward[k]
        w = weight_grad[k] if weight_grad is not None else backward[k] / 2
        step, inflight = _simulated_uniform(
            schedule, pp, m, v, round(forward[k] / unit, 2), round(w / unit, 2), round(p2p / unit, 3)
        )
        if schedule in REPLAYED:
            inflight = peak_inflight_closed(schedule, pp, m, v)
        return PipelineTime(step * unit, busy, inflight, True)
    step = closed_form(schedule, pp, m, v, forward, backward, weight_grad, p2p)
    return PipelineTime(step, busy, peak_inflight_closed(schedule, pp, m, v), False)
