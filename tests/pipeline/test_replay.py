"""The measured-against-simulated bubble comparison (llmtrain.pipeline.replay) on synthetic traces: a trace
the simulator itself produced is recovered exactly, a stall the schedule does not explain is caught. No
timing is asserted: the traces are made up, not measured."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmtrain.pipeline.replay import TOLERANCE, check_bubble, replay
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.pipeline.timeline import spans_from_simulation

V_AT_PP4 = [("zb_v", 2), ("dualpipe_v", 2), ("interleaved_zb", 2)]


def _synthetic(name: str, v: int, overhead: float = 0.02, p2p: float = 0.05, seed: int = 0):
    """A 'trace' of pp=4, m=8: the simulator's own timeline with uneven per-action durations (each drawn
    around F = 1, B = 2, W = 1 per stage), a host overhead between computes and a transfer latency."""
    schedule = build_schedule(name, 4, 8, v)
    rng = random.Random(seed)
    base = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    costs = {
        (rank, a.kind, a.microbatch, a.chunk): base[a.kind] / v * rng.uniform(0.8, 1.2)
        for rank in range(4) for a in schedule.compute(rank)
    }  # fmt: skip
    sim = simulate(schedule, 1.0, 2.0, 1.0, p2p=p2p, overhead=overhead, action_costs=costs)
    return schedule, spans_from_simulation(sim), sim


@pytest.mark.parametrize(("name", "v"), V_AT_PP4)
def test_a_trace_the_simulator_made_is_replayed_exactly(name, v):
    schedule, spans, sim = _synthetic(name, v)
    check = check_bubble(schedule, spans)
    # The replay recovers the overhead (median gap) and latency it was made with, up to float rounding.
    assert check.overhead == pytest.approx(0.02)
    assert check.p2p == pytest.approx(0.05)
    assert check.simulated == pytest.approx(sim.bubble_fraction, rel=1e-9)
    assert check.measured == pytest.approx(sim.bubble_fraction, rel=1e-9)
    assert check.relative_error < 1e-9 and check.within()


def test_a_stall_the_schedule_does_not_explain_fails_the_check():
    schedule, spans, _ = _synthetic("zb_v", 2)
    # Rank 2 stalls before its fourth compute for three forwards' time: every later span on it shifts.
    mine = sorted((s for s in spans if s.rank == 2), key=lambda s: s.start)
    t = mine[3].start
    stalled = [dataclasses.replace(s, start=s.start + 1.5, end=s.end + 1.5) if s.rank == 2 and s.start >= t
               else s for s in spans]  # fmt: skip
    check = check_bubble(schedule, stalled)
    assert check.measured > check.simulated
    assert not check.within()
    # (1 + measured) / (1 + simulated) is the ratio of the step times: busy time is the same on both sides.
    assert (1 + check.measured) / (1 + check.simulated) == pytest.approx(
        check.traced_step / check.simulated_step
    )
    assert check.step_error == pytest.approx(abs(check.measured - check.simulated) / (1 + check.simulated))
    assert TOLERANCE == 0.05


def test_replay_refuses_a_trace_missing_actions():
    schedule, spans, _ = _synthetic("interleaved_zb", 2)
    with pytest.raises(ValueError, match="the trace lacks 1 of interleaved_zb's computes"):
        replay(schedule, spans[1:])
