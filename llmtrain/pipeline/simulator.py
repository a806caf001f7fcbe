"""Replay a pipeline schedule with per-chunk costs: step time, bubble, activation memory; find deadlocks.

Pure Python (no torch), shared with the planner.

Execution model. Every rank runs its actions in order. A compute action starts when the rank is free and
takes its cost. A send is asynchronous: it costs the sender nothing and its data reaches the peer ``p2p``
time units later. A receive blocks the rank's next compute until the data has arrived. The executor's host
time between two computes (``overhead``: posting transfers, bookkeeping) runs before it waits for that data,
so a compute starts at the later of the previous compute's end plus ``overhead`` and its data's arrival.
Costs are per chunk, i.e. for ``1 / virtual_stages`` of a rank's layers.

Bubble fraction (Narayanan et al. 2021, the ``(p-1)/m`` of 1F1B): idle time over useful compute time,
``(pp * step_time - sum of busy time) / sum of busy time``. ``idle_fraction`` is the share of the step that
ranks sit idle, ``(p-1)/(m+p-1)`` for 1F1B.

In-flight micro-batches (activation memory): per rank, the most (micro-batch, chunk) pairs whose forward has
run and whose backward has not finished (B, or W when the backward is split, conservatively keeping
everything until the weight gradient is done). A schedule may mix both forms (dualpipe_v): each (micro-batch,
chunk) runs either B or I then W.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmtrain.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
)

Cost = float | Sequence[Sequence[float]] | Mapping[tuple[int, int], float]


class ScheduleError(RuntimeError):
    """A schedule is incomplete, violates a data dependency, or deadlocks."""


@dataclass(frozen=True)
class Event:
    """One executed action: ``rank`` ran ``action`` from ``start`` to ``end`` (equal for transfers)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    """What a replay measures; times are in the unit of the given costs."""

    step_time: float
    bubble_fraction: float
    """Idle over busy time summed over ranks (Megatron's definition; (p-1)/m for uniform 1F1B)."""
    idle_fraction: float
    """Idle over total rank time, pp * step_time."""
    busy: list[float]
    """Compute time per rank."""
    peak_inflight: list[int]
    """Per rank, the most (micro-batch, chunk) pairs with activations held at once."""
    events: list[Event]
    virtual_stages: int = 1

    @property
    def peak_activation(self) -> list[float]:
        """Per rank, peak activations in units of one micro-batch through a whole rank (all v chunks)."""
        return [n / self.virtual_stages for n in self.peak_inflight]


def _cost_lookup(name: str, cost: Cost, pp: int, v: int):
    """A function (rank, chunk) -> cost for a scalar, a [rank][chunk] table or a {(rank, chunk): cost} map."""
    if isinstance(cost, (int, float)):
        if cost < 0:
            raise ValueError(f"simulate: {name} cost must be >= 0; got {cost}")
        return lambda rank, chunk: float(cost)
    if isinstance(cost, Mapping):
        missing = [(r, c) for r in range(pp) for c in range(v) if (r, c) not in cost]
        if missing:
            raise ValueError(f"simulate: {name} cost table lacks (rank, chunk) entries {missing[:4]}")
        return lambda rank, chunk: float(cost[(rank, chunk)])
    if len(cost) != pp or any(len(row) != v for row in cost):
        raise ValueError(
            f"simulate: {name} cost table must be [pp={pp}][virtual_stages={v}] (rank, then chunk)"
        )
    return lambda rank, chunk: float(cost[rank][chunk])


@dataclass(frozen=True)
class _Where:
    """Names an action in an error message; formatted only when an error is raised."""

    schedule: str
    rank: int
    pos: int
    action: Action

    def __str__(self) -> str:
        return f"{self.schedule}: rank {self.rank} action {self.pos} ({self.action})"


def check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank computes every (micro-batch, chunk) exactly once per kind,
    each in dependency order on the rank, and every transfer has exactly one matching peer action."""
    pp, v, m = schedule.pp, schedule.virtual_stages, schedule.num_microbatches
    if len(schedule.actions) != pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for pp={pp} ranks")
    split = schedule.split_backward
    allowed = (F, B, I, W) if split else (F, B)
    last = schedule.num_stages - 1
    sends: dict[tuple[str, int, int], int] = {}
    recvs: dict[tuple[str, int, int], int] = {}
    for rank, acts in enumerate(schedule.actions):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(acts):
            where = _Where(schedule.name, rank, pos, a)
            if not (0 <= a.microbatch < m and 0 <= a.chunk < v):
                raise ScheduleError(f"{where}: micro-batch or chunk out of range (m={m}, v={v})")
            if a.kind not in allowed and a.is_compute:
                raise ScheduleError(f"{where}: kind {a.kind} not expected in a schedule using {allowed}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                raise ScheduleError(f"{where}: duplicate of action {seen[key]}")
            seen[key] = pos
            stage = schedule.stage(rank, a.chunk)
            if a.is_comm:
                stage_peer = stage + (1 if a.kind in (SEND_F, RECV_B) else -1)
                if not 0 <= stage_peer <= last or schedule.location(stage_peer)[0] != a.peer:
                    raise ScheduleError(f"{where}: peer should hold stage {stage_peer}")
                book = sends if a.kind.startswith("SEND") else recvs
                book[(a.kind[-1], a.microbatch, schedule.stage(rank, a.chunk))] = rank
        for mb in range(m):
            for c in range(v):
                # F, then either the full backward B or its halves I and W.
                has_b = (B, mb, c) in seen
                for kind in (F,) + ((B,) if has_b or not split else (I, W)):
                    if (kind, mb, c) not in seen:
                        raise ScheduleError(f"{schedule.name}: rank {rank} never runs {kind}{mb}.{c}")
                if has_b and ((I, mb, c) in seen or (W, mb, c) in seen):
                    raise ScheduleError(f"{schedule.name}: rank {rank} runs B{mb}.{c} and its I or W")
        # Local order: backward after forward, W after I.
        for (kind, mb, c), pos in seen.items():
            before = {B: F, I: F, W: I}.get(kind)
            if before and seen[(before, mb, c)] > pos:
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} runs {kind}{mb}.{c} at {pos} before {before}{mb}.{c} "
                    f"at {seen[(before, mb, c)]}"
                )
    # Every send of stage s's output is received by stage s+1 and vice versa.
    for (direction, mb, stage), rank in sends.items():
        dst = stage + 1 if direction == "F" else stage - 1
        if (direction, mb, dst) not in recvs:
            raise ScheduleError(
                f"{schedule.name}: rank {rank} sends {direction} of micro-batch {mb} stage {stage} but the "
                f"rank of stage {dst} never receives it"
            )
    for (direction, mb, stage), rank in recvs.items():
        src = stage - 1 if direction == "F" else stage + 1
        if (direction, mb, src) not in sends:
            raise ScheduleError(
                f"{schedule.name}: rank {rank} receives {direction} of micro-batch {mb} stage {stage} but "
                f"the rank of stage {src} never sends it"
            )


def held_and_owed(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, the most (micro-batch, chunk) pairs whose forward ran and whose input gradient (B or I) has
    not (their activations), and the most whose I ran and whose W has not (the weight-gradient stash)."""
    held, owed = [], []
    for rank in range(schedule.pp):
        live = stash = peak_live = peak_stash = 0
        for a in schedule.compute(rank):
            live += {F: 1, B: -1, I: -1}.get(a.kind, 0)
            stash += {I: 1, W: -1}.get(a.kind, 0)
            peak_live, peak_stash = max(peak_live, live), max(peak_stash, stash)
        held.append(peak_live)
        owed.append(peak_stash)
    return tuple(held), tuple(owed)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, chunk) pairs whose forward ran and whose backward has not finished."""
    peaks = []
    for rank in range(schedule.pp):
        live = peak = 0
        for a in schedule.compute(rank):
            if a.kind == F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (B, W):
                live -= 1
        peaks.append(peak)
    return peaks


def simulate(
    schedule: Schedule,
    forward: Cost,
    backward: Cost,
    weight_grad: Cost | None = None,
    p2p: Cost = 0.0,
    overhead: float = 0.0,
    action_costs: dict[tuple[int, str, int, int], float] | None = None,
    transfer_costs: Mapping[tuple[str, int, int], float] | None = None,
    checked: bool = False,
) -> SimulationResult:
    """Replay ``schedule``; ``backward`` is the full backward (I + W), ``weight_grad`` the W part of it
    (default half of backward) used by split-backward schedules, ``p2p`` the latency of a send from (rank,
    chunk), ``overhead`` the host time a rank spends between two of its computes (posting transfers,
    bookkeeping) before it waits for the compute's data, so the two overlap: idle time, in the bubble.
    Costs: a float, a [rank][chunk] table or a {(rank, chunk): cost} map. ``action_costs`` {(rank, kind,
    micro-batch, chunk): cost} gives single actions their own durations over the tables' (replaying a
    traced run action by action); ``transfer_costs`` {(direction "F" or "B", micro-batch, receiving
    stage): latency} gives single transfers their own latency over ``p2p``'s. ``checked``: this schedule
    has been replayed without error before, so its completeness and data dependencies are not checked
    again (the order in which the replay runs actions depends on the schedule only, never on the costs;
    the planner replays one schedule with the costs of many layouts).
    Raises ScheduleError on an incomplete schedule, a dependency violation or a deadlock."""
    if not checked:
        check_complete(schedule)
    pp, v = schedule.pp, schedule.virtual_stages
    fwd = _cost_lookup("forward", forward, pp, v)
    bwd = _cost_lookup("backward", backward, pp, v)
    wgt = _cost_lookup("weight_grad", weight_grad, pp, v) if weight_grad is not None else None
    lat = _cost_lookup("p2p", p2p, pp, v)

    def duration(rank: int, a: Action) -> float:
        own = action_costs.get((rank, a.kind, a.microbatch, a.chunk)) if action_costs else None
        if own is not None:
            return own
        if a.kind == F:
            return fwd(rank, a.chunk)
        if a.kind == B:
            return bwd(rank, a.chunk)
        w = wgt(rank, a.chunk) if wgt else bwd(rank, a.chunk) / 2
        if w > bwd(rank, a.chunk):
            raise ValueError(
                f"simulate: weight_grad ({w}) exceeds backward ({bwd(rank, a.chunk)}) on rank {rank}"
            )
        return w if a.kind == W else bwd(rank, a.chunk) - w

    # Arrival time of data, keyed by (direction, micro-batch, receiving global stage).
    arrivals: dict[tuple[str, int, int], float] = {}
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]
    received: list[set[tuple[str, int]]] = [set() for _ in range(pp)]
    clock = [0.0] * pp
    data = [0.0] * pp  # when the data of the rank's next compute has arrived
    busy = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []
    last = schedule.num_stages - 1
    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp):
            acts = schedule.actions[rank]
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                stage = schedule.stage(rank, a.chunk)
                if a.kind in (RECV_F, RECV_B):
                    key = (a.kind[-1], a.microbatch, stage)
                    if key not in arrivals:
                        break  # blocked: the peer has not sent yet
                    data[rank] = max(data[rank], arrivals[key])
                    received[rank].add((a.kind[-1], a.microbatch * v + a.chunk))
                    at = max(clock[rank], arrivals[key])
                    events.append(Event(rank, a, at, at))
                elif a.kind in (SEND_F, SEND_B):
                    produced = (F,) if a.kind == SEND_F else (I, B)
                    if not any((k, a.microbatch, a.chunk) in done[rank] for k in produced):
                        raise ScheduleError(
                            f"{schedule.name}: rank {rank} runs {a} before computing "
                            f"{'/'.join(produced)}{a.microbatch}.{a.chunk}"
                        )
                    dst = stage + 1 if a.kind == SEND_F else stage - 1
                    key = (a.kind[-1], a.microbatch, dst)
                    own = transfer_costs.get(key) if transfer_costs else None
                    arrivals[key] = clock[rank] + (lat(rank, a.chunk) if own is None else own)
                    events.append(Event(rank, a, clock[rank], clock[rank]))
                else:
                    if not checked:
                        _check_inputs(schedule, rank, a, stage, last, done, received)
                    # The host work runs while the data is in flight: the executor posts its transfers, then
                    # waits for the receives of this compute.
                    start = max(clock[rank] + (overhead if done[rank] else 0.0), data[rank])
                    clock[rank] = start + duration(rank, a)
                    busy[rank] += clock[rank] - start
                    done[rank].add((a.kind, a.microbatch, a.chunk))
                    events.append(Event(rank, a, start, clock[rank]))
                pos[rank] += 1
                progressed = True
    stuck = [(r, schedule.actions[r][pos[r]]) for r in range(pp) if pos[r] < len(schedule.actions[r])]
    if stuck:
        detail = "; ".join(f"rank {r} waits at {a}" for r, a in stuck)
        raise ScheduleError(
            f"{schedule.name} deadlocks (pp={pp}, m={schedule.num_microbatches}, v={v}): {detail}"
        )
    step = max(clock) if clock else 0.0
    total_busy = sum(busy)
    return SimulationResult(
        step_time=step,
        bubble_fraction=(pp * step - total_busy) / total_busy if total_busy else 0.0,
        idle_fraction=(pp * step - total_busy) / (pp * step) if step else 0.0,
        busy=busy,
        peak_inflight=peak_inflight(schedule),
        events=events,
        virtual_stages=v,
    )


def _check_inputs(
    schedule: Schedule,
    rank: int,
    a: Action,
    stage: int,
    last: int,
    done: list[set[tuple[str, int, int]]],
    received: list[set[tuple[str, int]]],
) -> None:
    """Raise ScheduleError if compute action ``a`` on ``rank`` lacks an input it needs."""
    v = schedule.virtual_stages
    slot = a.microbatch * v + a.chunk

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ScheduleError(f"{schedule.name}: rank {rank} runs {a} (stage {stage}) before {what}")

    if a.kind == F and stage > 0:
        prev_rank, prev_chunk = schedule.location(stage - 1)
        if prev_rank == rank:
            need(
                (F, a.microbatch, prev_chunk) in done[rank], f"F{a.microbatch}.{prev_chunk} on the same rank"
            )
        else:
            need(("F", slot) in received[rank], f"receiving its input from rank {prev_rank}")
    elif a.kind in (B, I):
        need((F, a.microbatch, a.chunk) in done[rank], f"F{a.microbatch}.{a.chunk}")
        if stage < last:
            next_rank, next_chunk = schedule.location(stage + 1)
            if next_rank == rank:
                need(
                    any((k, a.microbatch, next_chunk) in done[rank] for k in (I, B)),
                    f"I/B{a.microbatch}.{next_chunk} on the same rank",
                )
            else:
                need(("B", slot) in received[rank], f"receiving its output gradient from rank {next_rank}")
    elif a.kind == W:
        need((I, a.microbatch, a.chunk) in done[rank], f"I{a.microbatch}.{a.chunk}")
