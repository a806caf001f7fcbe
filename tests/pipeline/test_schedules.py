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
from llmtrain.config.layout_rules import CHUNKED_SCHEDULES, V_SCHEDULES
from llmtrain.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule, transfers_in_order
from llmtrain.pipeline.simulator import ScheduleError, simulate


def min_microbatches(name: str, pp: int, v: int) -> int:
    """The fewest micro-batches ``name`` runs (llmtrain.config.layout_rules.microbatch_problem)."""
    if name == "dualpipe_v":
        return 2 * pp
    return pp if name in CHUNKED_SCHEDULES and v > 1 else 1


@st.composite
def schedules(draw, names=SCHEDULES, min_m_multiple_of_pp: bool = False) -> Schedule:
    name = draw(st.sampled_from(names))
    pp = draw(st.integers(2 if name in V_SCHEDULES else 1, 6))
    v = 2 if name in V_SCHEDULES else draw(st.integers(1, 3)) if name in CHUNKED_SCHEDULES else 1
    lo = min_microbatches(name, pp, v)
    m = draw(st.integers(lo, lo + 2 * pp + 2))
    if min_m_multiple_of_pp:
        m = pp * draw(st.integers(1, 3))
    return build_schedule(name, pp, m, v)


def tick_replay(schedule: Schedule, cost: dict, p2p: int) -> tuple[int, dict]:
    """Independent replay in unit time steps. ``cost[(kind, rank, chunk)]`` are positive ints. A compute may
    start at tick t when its producers finished by t (t - p2p across ranks). Returns (makespan, starts)."""
    pp, v = schedule.pp, schedule.virtual_stages
    n_stages = pp * v
    queues = [[a for a in acts if a.is_compute] for acts in schedule.actions]
    finish: dict[tuple[str, int, int], int] = {}  # (kind, mb, global stage) -> finish tick
    starts: dict[tuple[int, Action], int] = {}
    busy_until = [0] * pp
    idx = [0] * pp
    t = 0
    horizon = sum(cost.values()) * sum(len(q) for q in queues) + 10 * p2p * n_stages + 10

    def ready(kinds: str, mb: int, stage: int, consumer_rank: int, now: int) -> bool:
        # ``kinds``: the actions any of which produces the input (B or I: the input gradient).
        done = [finish[(k, mb, stage)] for k in kinds if (k, mb, stage) in finish]
        if not done:
            return False
        lat = 0 if schedule.location(stage)[0] == consumer_rank else p2p
        return done[0] + lat <= now

    while any(idx[r] < len(queues[r]) for r in range(pp)):
        if t > horizon:
            raise AssertionError("tick replay: no progress (deadlock)")
        for r in range(pp):
            if busy_until[r] > t or idx[r] >= len(queues[r]):
                continue
            a = queues[r][idx[r]]
            s = schedule.stage(r, a.chunk)
            grad = "BI"
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
    kinds = [a.kind for a in computes]
    n = schedule.pp * schedule.num_microbatches * schedule.virtual_stages
    # Every (micro-batch, chunk): F, then B or I and W (dualpipe_v mixes the two forms).
    assert kinds.count("F") == kinds.count("B") + kinds.count("I") == n
    assert kinds.count("W") == kinds.count("I")
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
    for name in ("gpipe", "1f1b", "zb_h1", "interleaved_zb"):
        p, c = 4, 0.25
        result = simulate(build_schedule(name, p, 1), 1.0, 2.0, weight_grad=1.0, p2p=c)
        walk = p * 2.0 + 1.0 if name in ("zb_h1", "interleaved_zb") else p * 3.0
        assert result.step_time == pytest.approx(walk + 2 * (p - 1) * c)
    # ZB-V: 2p chunks of half a stage each way, but the bottom turn of the V is local: 2(p - 1) hops
    # each way (the first and last stage share rank 0). Two W (0.5 each) lie on the path: the last rank's
    # warm-up runs F I W of chunk 1 before the I of chunk 0, and the last W after the walk.
    result = simulate(build_schedule("zb_v", p, 1, 2), 0.5, 1.0, weight_grad=0.5, p2p=c)
    assert result.step_time == pytest.approx(2 * p * 1.0 + 2 * 0.5 + 2 * (2 * p - 2) * c)


def test_dispatch_overhead_is_idle_time_before_every_compute_but_a_ranks_first():
    # pp=1: F0 F1 F2 B0 B1 B2 back to back, so the step is the compute plus five gaps, none of them busy.
    one = simulate(build_schedule("gpipe", 1, 3), 1.0, 2.0, overhead=0.1)
    assert one.step_time == pytest.approx(9.0 + 5 * 0.1)
    assert one.busy == [pytest.approx(9.0)]
    # A single micro-batch through p ranks: a rank's first compute pays none. Its second (the backward)
    # pays it only on the last rank, whose backward follows its forward at once; the others wait for their
    # output gradient, and the executor does its host work (posting transfers) before that wait, so it hides.
    p = 4
    walk = simulate(build_schedule("1f1b", p, 1), 1.0, 2.0, overhead=0.1)
    assert walk.step_time == pytest.approx(p * 3.0 + 0.1)
    # Once the wait is shorter than the host work, the host work shows: 0.1 beyond a transfer of 0.04.
    slow = simulate(build_schedule("1f1b", p, 1), 1.0, 2.0, p2p=0.04, overhead=0.1)
    assert slow.step_time == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.04 + 0.1)


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
    for name in set(SCHEDULES) - set(V_SCHEDULES):
        s = build_schedule(name, 1, 3)
        assert all(a.is_compute for a in s.actions[0])
        assert uniform(s).bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("pipedream", 2, 4, 1), "parallel.schedule"),
        (("1f1b", 0, 4, 1), "parallel.pp"),
        (("1f1b", 2, 0, 1), "micro-batches"),
        (("1f1b", 2, 4, 2), "parallel.virtual_stages=2 needs parallel.schedule=interleaved_1f1b or"),
        (("interleaved_1f1b", 4, 3, 2), "at least parallel.pp=4 micro-batches"),
        (("interleaved_zb", 4, 3, 3), "at least parallel.pp=4 micro-batches.*zb_v"),
        (("zb_v", 4, 8, 1), "parallel.schedule=zb_v runs exactly two chunks per rank.*virtual_stages=2"),
        (("dualpipe_v", 4, 8, 3), "parallel.schedule=dualpipe_v runs exactly two chunks.*virtual_stages=2"),
        (("zb_v", 1, 8, 2), "parallel.schedule=zb_v .* needs parallel.pp > 1"),
        (("dualpipe_v", 4, 7, 2), r"dualpipe_v needs at least 2 \* parallel.pp = 8 micro-batches.*got 7"),
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


NEW_SCHEDULES = (("zb_v", 2), ("dualpipe_v", 2), ("interleaved_zb", 2), ("interleaved_zb", 3))


@pytest.mark.slow  # a few seconds: every shape, replayed twice
@pytest.mark.parametrize(("name", "v"), NEW_SCHEDULES)
def test_v_and_interleaved_zero_bubble_lists_are_deadlock_free_for_every_small_shape(name, v):
    # Brute force over every (pp, m) up to pp = 6 and m = 3 pp + 2 the schedule accepts. The simulator runs
    # the executor's rules (a send never blocks its sender; a receive blocks until the data is there) and
    # raises on a deadlock or a missing dependency; the tick replay derives dependencies from the stages
    # alone and raises if nothing can move. Costs skewed per kind, so no tie hides an ordering bug.
    for pp in range(2, 7):
        for m in range(min_microbatches(name, pp, v), 3 * pp + 3):
            s = build_schedule(name, pp, m, v)
            result = simulate(s, 1.0, 2.0, weight_grad=0.7, p2p=0.3)
            assert len([e for e in result.events if e.action.is_compute]) == sum(
                len(s.compute(r)) for r in range(pp)
            )
            cost = {(k, r, c): {"F": 2, "B": 5, "I": 3, "W": 2}[k] for k in "FBIW" for r in range(pp)
                    for c in range(v)}  # fmt: skip
            tick_replay(s, cost, 1)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_placement_puts_stages_r_and_2p_minus_1_minus_r_on_rank_r(name):
    s = build_schedule(name, 4, 8, 2)
    assert [(s.stage(r, 0), s.stage(r, 1)) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [s.location(st_) for st_ in range(8)] == [(r, 0) for r in range(4)] + [
        (r, 1) for r in (3, 2, 1, 0)
    ]
    text = s.format(comms=True)
    # The bottom of the V (stage 3 -> 4) stays on rank 3: its F of chunk 1 receives nothing; rank 0 holds
    # the first and the last stage, so its chunk 1 (the loss) sends no forward on.
    rank3 = text.splitlines()[4]
    assert "RECV_F0.1" not in rank3 and "SEND_F0.0" not in rank3
    assert "SEND_F0.1" not in text.splitlines()[1] and "RECV_F0.1<r1" in text.splitlines()[1]


def _torch_order(cls_name: str, pp: int, m: int, rank: int) -> list[str]:
    """The compute actions of torch.distributed.pipelining's schedule ``cls_name`` on ``rank`` as our
    ``kind mb.chunk`` strings (an overlapped F+B pair as its F then its B), built from stand-in stages."""
    import torch
    from torch.distributed.pipelining import schedules as torch_schedules

    class Stage:  # what the schedules' constructors read of a stage
        def __init__(self, index: int) -> None:
            self.stage_index, self.group_size, self.group_rank, self.num_stages = index, pp, rank, 2 * pp
            self.submod, self.is_first, self.is_last = torch.nn.Linear(1, 1), index == 0, index == 2 * pp - 1

    stages = [Stage(rank), Stage(2 * pp - 1 - rank)]
    order = getattr(torch_schedules, cls_name)(stages, m).pipeline_order[rank]
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out = []
    for a in order:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            chunk = 0 if sub.stage_index == rank else 1
            out.append(f"{kinds[sub.computation_type.name]}{sub.microbatch_index}.{chunk}")
    return out


@pytest.mark.slow  # imports torch
@pytest.mark.parametrize(
    ("name", "cls_name"), [("zb_v", "ScheduleZBVZeroBubble"), ("dualpipe_v", "ScheduleDualPipeV")]
)
def test_v_orders_equal_torchs_own(name, cls_name):
    # torch 2.13's ScheduleZBVZeroBubble and ScheduleDualPipeV (what torchtitan runs) order each rank's
    # computes exactly as ours, for shapes with few and many micro-batches (ZB-V below 2 pp - 1 too).
    for pp in (2, 3, 4):
        for m in sorted({2 * pp, 2 * pp + 1, 3 * pp} | ({1, pp} if name == "zb_v" else set())):
            ours = build_schedule(name, pp, m, 2)
            for rank in range(pp):
                assert [str(a) for a in ours.compute(rank)] == _torch_order(cls_name, pp, m, rank), (
                    pp,
                    m,
                    rank,
                )


def test_zb_v_bubble_is_below_1f1b_and_interleaved_at_equal_memory():
    # Qi et al. 2023, section 6 and table 4: ZB-V's peak activation memory equals 1F1B's (pp micro-batches
    # of a whole stage on the fullest rank), and with T_F = T_I = T_W its bubble is far below 1F1B's and
    # interleaved 1F1B's (which needs more memory). Here pp = 4, m = 8, a stage's F = 1, B = 2, W = 1.
    p, m = 4, 8
    zbv = simulate(build_schedule("zb_v", p, m, 2), 0.5, 1.0, weight_grad=0.5)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    inter = simulate(build_schedule("interleaved_1f1b", p, m, 2), 0.5, 1.0)
    assert max(zbv.peak_activation) == max(one.peak_activation) == p
    assert max(inter.peak_activation) > p
    assert zbv.bubble_fraction == pytest.approx(1.5 / 24)  # (p - 1) T_W / (m * 3) of a chunk's costs
    assert one.bubble_fraction == pytest.approx((p - 1) / m)
    assert inter.bubble_fraction == pytest.approx((p - 1) / (2 * m))
    assert zbv.bubble_fraction < inter.bubble_fraction < one.bubble_fraction
    # The fill of the V shrinks with more micro-batches: (p - 1) / (6 m), half at m = 16.
    more = simulate(build_schedule("zb_v", p, 2 * m, 2), 0.5, 1.0, weight_grad=0.5)
    assert more.bubble_fraction == pytest.approx((p - 1) / (6 * 2 * m))
