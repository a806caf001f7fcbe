"""The planner's pipeline closed forms against the pipeline simulator (llmtrain.pipeline.simulator)."""

import pytest

from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.planner.cost.pipeline_time import closed_form, peak_inflight_closed, pipeline_time

COSTS = [
    (1.0, 2.0, 0.8, 0.0),
    (1.0, 2.0, 1.0, 0.05),
    (0.7, 1.9, 0.9, 0.14),
]  # W <= I, as the cost model produces


def shapes():
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 5, 8, 16, 24):
                for v in (2, 3) if name == "interleaved_1f1b" else (1,):
                    if name == "interleaved_1f1b" and (p == 1 or m % p):
                        continue
                    if name == "zb_h1" and m <= p:
                        continue
                    yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(shapes()))
def test_closed_forms_equal_the_simulator_for_uniform_costs(name, p, m, v):
    sched = build_schedule(name, p, m, v)
    for f, b, w, c in COSTS:
        sim = simulate(sched, f, b, w, c)
        assert closed_form(name, p, m, v, [f] * p, [b] * p, [w] * p, c) == pytest.approx(
            sim.step_time, rel=1e-9
        )
        assert peak_inflight_closed(name, p, m, v) == sim.peak_inflight[0]


def test_uneven_stages_stay_close_to_the_simulator():
    # Heavier last stage (logits): the closed form sets the steady state by the slowest rank.
    p, m = 4, 16
    fwd, bwd = [1.0, 1.0, 1.0, 1.3], [2.0, 2.0, 2.0, 2.5]
    sim = simulate(build_schedule("1f1b", p, m), [[x] for x in fwd], [[x] for x in bwd], None, 0.02)
    approx = closed_form("1f1b", p, m, 1, fwd, bwd, None, 0.02)
    assert approx == pytest.approx(sim.step_time, rel=0.05)


def test_small_shapes_are_replayed_by_the_simulator():
    res = pipeline_time("zb_h1", 4, 2, 1, [1.0] * 4, [2.0] * 4, [0.8] * 4, 0.0)
    sim = simulate(build_schedule("zb_h1", 4, 2), 1.0, 2.0, 0.8, 0.0)
    assert res.simulated and res.step_time == pytest.approx(
        sim.step_time, rel=0.01
    )  # costs rounded to share replays
    exact = pipeline_time("1f1b", 4, 8, 1, [1.0, 1.1, 1.0, 1.2], [2.0] * 4, None, 0.1, use_simulator=True)
    assert exact.simulated
    assert exact.bubble_fraction == pytest.approx(1 - exact.busy / exact.step_time)


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v", "interleaved_zb"])
def test_v_and_interleaved_zero_bubble_are_timed_by_the_simulator_and_peaks_read_off_their_lists(name):
    from llmtrain.pipeline.simulator import held_and_owed
    from llmtrain.planner.cost.memory import pending_weight_grads

    p, m, v = 4, 16, 2
    # Per-chunk costs: the replay (normalised, rounded to share replays) is the simulator's step.
    res = pipeline_time(name, p, m, v, [0.5] * p, [1.0] * p, [0.4] * p, 0.02)
    sched = build_schedule(name, p, m, v)
    sim = simulate(sched, 0.5, 1.0, 0.4, 0.02)
    assert res.simulated and res.step_time == pytest.approx(sim.step_time, rel=0.01)
    # Beyond the replay's reach the closed form stays within 5% of the simulator on this grid.
    for f, b, w, c in COSTS:
        approx = closed_form(name, p, m, v, [f / v] * p, [b / v] * p, [w / v] * p, c)
        assert approx == pytest.approx(simulate(sched, f / v, b / v, w / v, c).step_time, rel=0.05)
    # Memory: activations held until the input gradient, the weight-gradient stash apart; both peak in the
    # warm-up, so 3 pp micro-batches give the peaks of any count.
    held, owed = held_and_owed(sched)
    assert peak_inflight_closed(name, p, m, v) == held[0]
    assert held_and_owed(build_schedule(name, p, 3 * p, v)) == (held, owed)
    assert [pending_weight_grads(name, p, m, r, v) for r in range(p)] == [n / v for n in owed]
    # ZB-V holds 1F1B's activations: p micro-batches through a whole rank (2p chunk pairs) on every rank.
    if name == "zb_v":
        assert list(held) == [2 * p] * p
