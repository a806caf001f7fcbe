"""The replay of a traced step (llmtrain.pipeline.replay) with its traced transfers: the executor's host
work runs before it waits for a compute's data (so the two overlap), and each direction's transfers are
charged their own measured latency.

Before this, the replay charged the host time after the wait and took one latency from forward hand-offs
only; DualPipeV's waits are mostly for backward gradients. On the stored gloo trace below that replay was
6.6% off the measured bubble (outside the issue's 5%); both tests here fail under it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmtrain.pipeline.comm_trace import CommEvent
from llmtrain.pipeline.replay import TOLERANCE, check_bubble
from llmtrain.pipeline.schedules import RECV_B, RECV_F, F, W, build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.pipeline.timeline import Span, spans_from_simulation

TRACE = Path(__file__).parent / "traces" / "dualpipe_v_pp4_m8_gloo.json"


def test_a_traced_gloo_step_of_dualpipe_v_is_within_5_percent_of_its_replay():
    # One real step (its "about" field says how it was made); measured, not synthetic, so the bound is the
    # issue's 5%, not a float tolerance. Measured 0.385, replayed 0.374 (2.9%).
    data = json.loads(TRACE.read_text())
    spans = [Span(**e) for e in data["events"]]
    comms = [CommEvent(**e) for e in data["comms"]]
    check = check_bubble(build_schedule("dualpipe_v", 4, 8, 2), spans, comms)
    assert check.relative_error <= TOLERANCE, check


def _synthetic_with_transfers(name: str, overhead: float, p2p: dict[str, float]):
    """A pp=4, m=8 step the simulator made with uneven durations, host work ``overhead`` before each wait
    and per-direction latencies, with the receive waits the executor would trace for it."""
    schedule = build_schedule(name, 4, 8, 2)
    rng = random.Random(0)
    base = {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5}
    costs = {
        (rank, a.kind, a.microbatch, a.chunk): base[a.kind] * rng.uniform(0.8, 1.2)
        for rank in range(4) for a in schedule.compute(rank)
    }  # fmt: skip
    hops = {
        (a.kind[-1], a.microbatch, schedule.stage(rank, a.chunk)): p2p[a.kind[-1]]
        for rank in range(4) for a in schedule.actions[rank] if a.kind in (RECV_F, RECV_B)
    }  # fmt: skip
    sim = simulate(schedule, 1.0, 2.0, overhead=overhead, action_costs=costs, transfer_costs=hops)
    spans = spans_from_simulation(sim)
    comms = []
    for rank in range(4):
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
        for before, s in zip([None, *mine], mine, strict=False):
            kind = RECV_F if s.kind == F else RECV_B
            if s.kind == W:
                continue
            stage = schedule.stage(rank, s.chunk)
            if (kind[-1], s.microbatch, stage) not in hops:
                continue
            # The executor posts its transfers (host work), then waits until the data is there.
            needed = min(s.start, before.end + overhead) if before else s.start
            comms.append(CommEvent(rank, kind, s.microbatch, s.chunk, needed, needed, s.start))
    return schedule, spans, comms, sim


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v", "interleaved_zb"])
def test_host_work_before_the_wait_and_slow_gradients_are_replayed_exactly(name):
    schedule, spans, comms, sim = _synthetic_with_transfers(name, 0.02, {"F": 0.01, "B": 0.08})
    check = check_bubble(schedule, spans, comms)
    # Recovered up to float rounding: the host time from the gaps less the waits, each direction's latency
    # from the hand-offs whose consumer waited.
    assert check.overhead == pytest.approx(0.02)
    assert (check.p2p, check.p2p_backward) == (pytest.approx(0.01), pytest.approx(0.08))
    assert check.simulated == pytest.approx(sim.bubble_fraction, rel=1e-9)
    assert check.relative_error < 1e-9
