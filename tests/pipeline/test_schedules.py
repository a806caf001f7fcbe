"""Schedules and simulator: completeness, dependency order, deadlock freedom and bubble closed forms.

References: the closed forms of Narayanan et al. 2021 (1F1B / GPipe bubble (p-1)/m, interleaved (p-1)/(v*m),
peak in-flight p - rank, interleaved warm-up 2(p-r-1)+(v-1)p), Qi et al. 2023 (ZB-H1 bubble a third of
1F1B's at 1F1B's peak memory), and an independent tick-by-tick replay written here that derives dependencies
from stage arithmetic alone (it ignores the SEND/RECV actions the simulator relies on).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtrain.config.errors import ConfigError
from llmtrain.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule, transfers_in_order
from llmtrain.pipeline.simulator import ScheduleError, simulate


@st.composite
def schedules(draw, names=SCHEDULES, min_m_multiple_of_pp: bool = False) -> Schedule:
    name = draw(st.sampled_from(names))
    pp = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if name == "interleaved_1f1b" else 1
    lo = pp if (name == "interleaved_1f1b" and v > 1) else 1
    m = draw(st.integers(lo, 3 * pp + 2))
    if min_m_multiple_of_pp:
        m = pp * draw(st.integers(1, 3))
    return build_schedule(name, pp, m, v)


def tick_replay(schedule: Schedule, cost: dict, p2p: int) -> tuple[int, dict]:
    """Independent replay in unit time steps. ``cost[(kind, rank, chunk)]`` are positive ints. A compute may
    start at tick t when its producers finished by t (t - p2p across ranks). Returns (makespan, starts)."""
    pp, v = schedule.pp, schedule.virtual_stages
    n_stages = pp * v
    split = any(a.kind == "I" for r in schedule.actions for a in r)
    queues = [[a for a in acts if a.is_compute] for acts in schedule.actions]
    finish: dict[tuple[str, int, int], int] = {}  # (kind, mb, global stage) -> finish tick
    starts: dict[tuple[int, Action], int] = {}
    busy_until = [0] * pp
    idx = [0] * pp
    t = 0
    horizon = sum(cost.values()) * sum(len(q) for q in queues) + 10 * p2p * n_stages + 10

    def ready(kind: str, mb: int, stage: int, consumer_rank: int, now: int) -> bool:
        key = (kind, mb, stage)
        if key not in finish:
            return False
        lat = 0 if stage % pp == consumer_rank else p2p
        return finish[key] + lat <= now

    while any(idx[r] < len(queues[r]) for r in range(pp)):
        if t > horizon:
            raise AssertionError("tick replay: no progress (deadlock)")
        for r in range(pp):
            if busy_until[r] > t or idx[r] >= len(queues[r]):
                continue
            a = queues[r][idx[r]]
            s = a.chunk * pp + r
            grad = "I" if split else "B"
            deps = []
            if a.kind == "F" and s > 0:
                deps.append(("F", s - 1))
            if a.kind in ("B", "I"):
                deps.append(("F", s))
                if s < n_stages - 1:
                    deps.append((grad, s + 1))
            if a.kind == "W":
                deps.append(("I", s))
            if all(ready(k, a.microbatch, st_, r, t) for k, st_ in deps):
                starts[(r, a)] = t
                busy_until[r] = t + cost[(a.kind, r, a.chunk)]
                finish[(a.kind, a.microbatch, s)] = busy_until[r]
                idx[r] += 1
        t += 1
    return max(busy_until), starts


def uniform(schedule: Schedule, f: float = 1.0, b: float = 2.0):
    v = schedule.virtual_stages
    return simulate(schedule, f / v, b / v, weight_grad=b / v / 2)


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_every_schedule_is_complete_and_deadlock_free(schedule):
    # simulate() checks completeness and dependencies first and raises on a deadlock.
    result = uniform(schedule)
    computes = [a for r in range(schedule.pp) for a in schedule.compute(r)]
    per_mb_chunk = 3 if schedule.split_backward else 2
    assert len(computes) == schedule.pp * schedule.num_microbatches * schedule.virtual_stages * per_mb_chunk
    assert len([e for e in result.events if e.action.is_compute]) == len(computes)


@settings(max_examples=150, deadline=None)
@given(
    schedules(),
    st.lists(st.integers(1, 4), min_size=3, max_size=3),
    st.integers(0, 3),
    st.randoms(use_true_random=False),
)
def test_simulator_matches_independent_tick_replay(schedule, base, p2p, rnd):
    # Integer, per (rank, chunk) costs: F, full backward B = I + W with I, W >= 1.
    pp, v = schedule.pp, schedule.virtual_stages
    fwd = [[base[0] + rnd.randint(0, 2) for _ in range(v)] for _ in range(pp)]
    inp = [[base[1] + rnd.randint(0, 2) for _ in range(v)] for _ in range(pp)]
    wgt = [[base[2] + rnd.randint(0, 2) for _ in range(v)] for _ in range(pp)]
    full = [[inp[r][c] + wgt[r][c] for c in range(v)] for r in range(pp)]
    cost = {}
    for r in range(pp):
        for c in range(v):
            cost[("F", r, c)] = fwd[r][c]
            cost[("B", r, c)] = full[r][c]
            cost[("I", r, c)] = inp[r][c]
            cost[("W", r, c)] = wgt[r][c]
    result = simulate(schedule, fwd, full, weight_grad=wgt, p2p=float(p2p))
    makespan, starts = tick_replay(schedule, cost, p2p)
    assert result.step_time == makespan
    for e in result.events:
        if e.action.is_compute:
            assert e.start == starts[(e.rank, e.action)], (e.rank, str(e.action))


def test_transfers_between_two_ranks_are_posted_in_matching_order():
    # NCCL matches by order: every schedule with micro-batches a multiple of pp keeps the two sides in step.
    for name, v in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("interleaved_1f1b", 3),
        ("zb_h1", 1),
    ):
        for p in range(1, 6):
            for m in (p, 2 * p, 3 * p):
                assert transfers_in_order(build_schedule(name, p, m, v)), (name, p, m, v)
    # pp=2 interleaved with an odd count crosses forward and backward transfers on the same link.
    assert not transfers_in_order(build_schedule("interleaved_1f1b", 2, 5, 2))


@settings(max_examples=100, deadline=None)
@given(schedules(names=("gpipe", "1f1b")))
def test_gpipe_and_1f1b_bubble_and_memory_closed_forms(schedule):
    p, m = schedule.pp, schedule.num_microbatches
    result = uniform(schedule)
    assert result.bubble_fraction == pytest.approx((p - 1) / m)
    assert result.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.step_time == pytest.approx((m + p - 1) * 3.0)
    if schedule.name == "1f1b":
        assert result.peak_inflight == [min(p - r, m) for r in range(p)]
    else:
        assert result.peak_inflight == [m] * p


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.data())
def test_interleaved_bubble_and_memory_closed_forms(p, v, data):
    m = data.draw(st.integers(p, 4 * p))
    result = uniform(build_schedule("interleaved_1f1b", p, m, v))
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m))
    if m % p == 0:
        # Megatron's warm-up plus the one forward of the first steady-state step; a chunk is 1/v of a rank.
        expected = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
        assert result.peak_inflight == expected
        assert result.peak_activation == pytest.approx([n / v for n in expected])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.data())
def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_peak_memory(p, data):
    m = data.draw(st.integers(p, 4 * p))
    # T_F = T_I = T_W = 1 as in the paper: full backward 2, weight part 1.
    zb = simulate(build_schedule("zb_h1", p, m), 1.0, 2.0, weight_grad=1.0)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert zb.bubble_fraction == pytest.approx(one.bubble_fraction / 3)
    assert zb.step_time == pytest.approx(3 * m + (p - 1))
    assert max(zb.peak_inflight) == max(one.peak_inflight) == p


def test_latency_of_a_single_microbatch_is_one_transfer_per_hop_each_way():
    # One micro-batch walks down the pipeline and back: p forwards, p backwards, 2(p-1) transfers; with a
    # split backward the last W (1.0 of the 2.0) runs after the walk.
    for name in SCHEDULES:
        p, c = 4, 0.25
        result = simulate(build_schedule(name, p, 1), 1.0, 2.0, weight_grad=1.0, p2p=c)
        walk = p * 2.0 + 1.0 if name == "zb_h1" else p * 3.0
        assert result.step_time == pytest.approx(walk + 2 * (p - 1) * c)


def test_dispatch_overhead_is_idle_time_before_every_compute_but_a_ranks_first():
    # pp=1: F0 F1 F2 B0 B1 B2 back to back, so the step is the compute plus five gaps, none of them busy.
    one = simulate(build_schedule("gpipe", 1, 3), 1.0, 2.0, overhead=0.1)
    assert one.step_time == pytest.approx(9.0 + 5 * 0.1)
    assert one.busy == [pytest.approx(9.0)]
    # A single micro-batch through p ranks: a rank's first compute pays none, its second (the backward) one.
    p = 4
    walk = simulate(build_schedule("1f1b", p, 1), 1.0, 2.0, overhead=0.1)
    assert walk.step_time == pytest.approx(p * 3.0 + p * 0.1)


def test_action_costs_replay_single_actions():
    # One slow forward (micro-batch 1 on the first rank) delays everything downstream of it by its excess.
    sched = build_schedule("gpipe", 2, 2)
    base = simulate(sched, 1.0, 2.0)
    slow = simulate(sched, 1.0, 2.0, action_costs={(0, "F", 1, 0): 4.0})
    assert slow.step_time == pytest.approx(base.step_time + 3.0)
    assert slow.busy == [pytest.approx(base.busy[0] + 3.0), pytest.approx(base.busy[1])]


def test_orders_match_the_papers_figures():
    # Narayanan et al. 2021, Fig. 3 (1F1B, 4 devices, 8 micro-batches): device 1 and 4.
    s = build_schedule("1f1b", 4, 8)
    assert s.format().splitlines()[1] == "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert s.format().splitlines()[4] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    # Fig. 4 (interleaved, 2 chunks): device 1 runs micro-batches 1-4 through chunk 1, then chunk 2, then
    # 5 and 6 of chunk 1 before its first backward, which is of its second chunk.
    rank0 = [str(a) for a in build_schedule("interleaved_1f1b", 4, 8, 2).compute(0)]
    expected = "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 F6.0 B0.1 F7.0"
    assert " ".join(rank0[:13]) == expected


def test_schedule_prints_a_table_and_transfers():
    s = build_schedule("zb_h1", 2, 2)
    text = str(s)
    assert "rank 0: F0 F1 I0 W0 I1 W1" in text
    assert "rank 1: F0 I0 F1 I1 W0 W1" in text
    assert "SEND_F0.0>r1" in s.format(comms=True)
    assert "RECV_B0.0<r1" in s.format(comms=True)


def test_pp1_is_forward_then_backward_without_transfers():
    for name in SCHEDULES:
        s = build_schedule(name, 1, 3)
        assert all(a.is_compute for a in s.actions[0])
        assert uniform(s).bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("pipedream", 2, 4, 1), "parallel.schedule"),
        (("1f1b", 0, 4, 1), "parallel.pp"),
        (("1f1b", 2, 0, 1), "micro-batches"),
        (("1f1b", 2, 4, 2), "parallel.virtual_stages=2 needs parallel.schedule=interleaved_1f1b"),
        (("interleaved_1f1b", 4, 3, 2), "at least parallel.pp=4 micro-batches"),
    ],
)
def test_bad_arguments_name_the_field(args, needle):
    with pytest.raises(ConfigError, match=needle):
        build_schedule(*args)


def _replace(schedule: Schedule, rank: int, acts: list[str]) -> Schedule:
    """A copy of ``schedule`` with rank's actions reordered to the given string forms."""
    by_name = {str(a): a for a in schedule.actions[rank]}
    new = [list(a) for a in schedule.actions]
    new[rank] = [by_name[x] for x in acts]
    return Schedule(schedule.name, schedule.pp, schedule.num_microbatches, schedule.virtual_stages, new)


def test_deadlock_is_reported_with_ranks_and_actions():
    s = build_schedule("1f1b", 2, 2)
    # Rank 0 waits for a gradient before sending any activation: rank 1 can never start.
    bad = _replace(s, 0, "RECV_B0.0<r1 F0.0 SEND_F0.0>r1 F1.0 SEND_F1.0>r1 B0.0 RECV_B1.0<r1 B1.0".split())
    with pytest.raises(
        ScheduleError, match=r"deadlocks.*rank 0 waits at RECV_B0.0<r1.*rank 1 waits at RECV_F0.0<r0"
    ):
        simulate(bad, 1.0, 2.0)


def test_dependency_violation_names_rank_and_action():
    s = build_schedule("1f1b", 2, 2)
    bad = _replace(s, 0, "F0.0 SEND_F0.0>r1 F1.0 SEND_F1.0>r1 B0.0 RECV_B0.0<r1 RECV_B1.0<r1 B1.0".split())
    with pytest.raises(
        ScheduleError, match=r"rank 0 runs B0.0 .*before receiving its output gradient from rank 1"
    ):
        simulate(bad, 1.0, 2.0)
    missing = Schedule(s.name, 2, 2, 1, [s.actions[0], [a for a in s.actions[1] if str(a) != "B1.0"]])
    with pytest.raises(ScheduleError, match="rank 1 never runs B1.0"):
        simulate(missing, 1.0, 2.0)
    unmatched = Schedule(
        s.name, 2, 2, 1, [s.actions[0], [a for a in s.actions[1] if str(a) != "RECV_F1.0<r0"]]
    )
    with pytest.raises(ScheduleError, match="never receives"):
        simulate(unmatched, 1.0, 2.0)


def test_cost_tables_are_validated():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"forward cost table must be \[pp=2\]\[virtual_stages=1\]"):
        simulate(s, [[1.0]], 2.0)
    with pytest.raises(ValueError, match="lacks"):
        simulate(s, {(0, 0): 1.0}, 2.0)
    # A per-(rank, chunk) map works and a slow last stage sets the pace of the steady state.
    slow = simulate(s, {(0, 0): 1.0, (1, 0): 2.0}, 2.0)
    assert slow.step_time > simulate(s, 1.0, 2.0).step_time
