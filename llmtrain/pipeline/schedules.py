"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it performs in one step.

Pure Python (no torch): the planner imports this to evaluate thousands of layouts quickly.

Layout. The model is cut into ``pp * virtual_stages`` consecutive stages; rank ``r`` holds the local chunks
``c = 0 .. v-1``. In the looped placement chunk ``c`` is global stage ``c * pp + r`` (Megatron's interleaved
layout, so with ``v = 1`` rank ``r`` simply holds stage ``r``). The V schedules (``zb_v``, ``dualpipe_v``)
place two chunks in a V: rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``, so the first and the last stage
share rank 0 and the turn at the bottom (stage ``pp - 1`` to ``pp``) stays on rank ``pp - 1``.

Actions. ``F`` forward, ``B`` full backward, or for zero-bubble schedules ``I`` (input gradient, what the
previous stage waits for) and ``W`` (weight gradient, deferrable); ``dualpipe_v`` mixes both forms, a
(micro-batch, chunk) running either ``B`` or ``I`` then ``W``. Each compute action is surrounded by the
transfers it implies: ``RECV_F`` (the input activation) right before a forward of a stage > 0, ``SEND_F``
right after a forward of a stage below the last, ``RECV_B`` (the output gradient) right before a
backward/``I`` of a stage below the last, ``SEND_B`` right after a backward/``I`` of a stage > 0.
Transfers between chunks on the same rank (``pp = 1``, the bottom of a V) are local and get no actions.
Consecutive transfers form one batch for the executor (e.g. Megatron's ``send_forward_recv_backward``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmtrain.config.errors import ConfigError
from llmtrain.config.layout_rules import V_SCHEDULES, microbatch_problem, schedule_problem

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 - the names used in the zero-bubble paper
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_KINDS = (F, B, I, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "interleaved_zb")


def stage_of(v_shape: bool, pp: int, rank: int, chunk: int) -> int:
    """Global stage held by ``rank`` as local ``chunk``: looped (``chunk * pp + rank``) or in a V."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of_stage(v_shape: bool, pp: int, stage: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding global ``stage`` (the inverse of ``stage_of``)."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


@dataclass(frozen=True)
class Action:
    """One step of a rank: a compute (F/B/I/W) or a transfer (SEND_*/RECV_*) of one micro-batch's chunk."""

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None
    """The other pipeline rank of a transfer; None for compute actions."""

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        base = f"{self.kind}{self.microbatch}.{self.chunk}"
        if self.peer is None:
            return base
        return f"{base}{'>' if self.kind.startswith('SEND') else '<'}r{self.peer}"


@dataclass
class Schedule:
    """A complete pipeline schedule: ``actions[rank]`` is the ordered action list of that pipeline rank."""

    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    actions: list[list[Action]] = field(repr=False)
    v_shape: bool = False
    """Chunks placed in a V (rank r: stages r and 2 pp - 1 - r) rather than looped."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """True when some backward is split into I and W actions (zero-bubble schedules)."""
        return any(a.kind == I for rank in self.actions for a in rank)

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage index held by ``rank`` as local ``chunk``."""
        return stage_of(self.v_shape, self.pp, rank, chunk)

    def location(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding global ``stage``."""
        return rank_of_stage(self.v_shape, self.pp, stage)

    def compute(self, rank: int) -> list[Action]:
        """The compute actions of ``rank`` in order (transfers left out)."""
        return [a for a in self.actions[rank] if a.is_compute]

    def format(self, comms: bool = False) -> str:
        """A table, one row per rank; ``comms`` includes the transfers."""
        short = self.virtual_stages == 1
        rows = []
        for rank, acts in enumerate(self.actions):
            cells = [
                (f"{a.kind}{a.microbatch}" if short and a.is_compute else str(a))
                for a in acts
                if comms or a.is_compute
            ]
            rows.append(f"rank {rank}: " + " ".join(cells))
        header = (
            f"{self.name}: pp={self.pp} microbatches={self.num_microbatches} "
            f"virtual_stages={self.virtual_stages} (cells: kind+microbatch{'' if short else '.chunk'})"
        )
        return "\n".join([header, *rows])

    def __str__(self) -> str:
        return self.format()


def _with_transfers(
    pp: int, v: int, order: list[list[tuple[str, int, int]]], v_shape: bool = False
) -> list[list[Action]]:
    """Surround each compute action by the sends and receives it implies (see module docstring)."""
    last = pp * v - 1
    out: list[list[Action]] = []
    for rank, computes in enumerate(order):
        acts: list[Action] = []
        for kind, mb, chunk in computes:
            stage = stage_of(v_shape, pp, rank, chunk)
            prev_rank = rank_of_stage(v_shape, pp, stage - 1)[0] if stage > 0 else rank
            next_rank = rank_of_stage(v_shape, pp, stage + 1)[0] if stage < last else rank
            if kind == F and prev_rank != rank:
                acts.append(Action(RECV_F, mb, chunk, prev_rank))
            if kind in (B, I) and next_rank != rank:
                acts.append(Action(RECV_B, mb, chunk, next_rank))
            acts.append(Action(kind, mb, chunk))
            if kind == F and next_rank != rank:
                acts.append(Action(SEND_F, mb, chunk, next_rank))
            if kind in (B, I) and prev_rank != rank:
                acts.append(Action(SEND_B, mb, chunk, prev_rank))
        out.append(acts)
    return out


def _gpipe(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [[(F, i, 0) for i in range(m)] + [(B, i, 0) for i in range(m)] for _ in range(pp)]


def _one_f_one_b(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """PipeDream-Flush: pp-rank-1 warm-up forwards, then alternate one forward and one backward."""
    order = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        seq = [(F, i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            seq += [(F, warmup + i, 0), (B, i, 0)]
        seq += [(B, i, 0) for i in range(m - warmup, m)]
        order.append(seq)
    return order


def _interleaved_groups(m: int, group: int) -> list[range]:
    """Micro-batches in groups of ``group`` (Megatron's microbatch_group_size_per_vp_stage = pp); the
    remainder m % group joins the last group, so no group is smaller than the pipeline."""
    starts = list(range(0, m - m % group if m >= group else m, group)) or [0]
    return [range(s, starts[i + 1] if i + 1 < len(starts) else m) for i, s in enumerate(starts)]


def _interleaved(pp: int, m: int, v: int, round_trip: int = 2) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, warm-up
    round_trip*(pp-rank-1) + (v-1)*pp forwards (more when m % pp != 0), backwards visiting chunks in
    reverse."""
    if v == 1:
        return _one_f_one_b(pp, m, v)
    groups = _interleaved_groups(m, pp)
    # Forwards run group by group through every chunk; the backward of chunk v-1-c follows that of c, so a
    # rank must run ahead by (v-1) * the largest group, plus round_trip*(pp-rank-1) for the first backward's
    # way down and back up.
    table = [(mb, c) for g in groups for c in range(v) for mb in g]
    largest = max(len(g) for g in groups)
    total = m * v
    order = []
    for rank in range(pp):
        warmup = min(round_trip * (pp - rank - 1) + (v - 1) * largest, total)
        fwd = [(F, mb, c) for mb, c in table]
        bwd = [(B, mb, v - 1 - c) for mb, c in table]
        seq = fwd[:warmup]
        for k in range(total - warmup):
            seq += [fwd[warmup + k], bwd[k]]
        seq += bwd[total - warmup :]
        order.append(seq)
    return order


def _zb_h1(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I and W, rank r running W(i - r) after
    I(i). Deferring W by r micro-batches makes every rank hold at most pp micro-batches (1F1B's peak, on rank
    0) while the deferred W fill the cool-down; bubble (pp-1)(T_F + T_I - T_W), a third of 1F1B's when
    T_F = T_I = T_W and there are at least pp micro-batches."""
    order = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        seq = [(F, i, 0) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                seq.append((F, warmup + i, 0))
            seq.append((I, i, 0))
            if i >= rank:
                seq.append((W, i - rank, 0))
        seq += [(W, i, 0) for i in range(max(0, m - rank), m)]
        order.append(seq)
    return order


def _interleaved_zb(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Interleaved 1F1B with the backward split (the ZB-1P idea of Qi et al. 2023 on Megatron's interleaved
    order, as torch's ScheduleInterleavedZeroBubble): every B becomes an I, and rank r runs the W of its k-th
    backward after its (k + r)-th I, as ZB-H1 does, so the deferred W fill the cool-down. The warm-up is
    torch's: one forward per downstream rank, not interleaved 1F1B's two (an I is about as long as an F,
    half a full backward), so rank r holds (v-1)*pp + pp - r micro-batch chunks at most, not
    (v-1)*pp + 2(pp - r) - 1; the W fill the slots where an I is not back yet."""
    order = []
    for rank, seq in enumerate(_interleaved(pp, m, v, round_trip=1)):
        out: list[tuple[str, int, int]] = []
        done: list[tuple[int, int]] = []
        owed = 0
        for kind, mb, chunk in seq:
            if kind != B:
                out.append((kind, mb, chunk))
                continue
            out.append((I, mb, chunk))
            done.append((mb, chunk))
            if len(done) > rank:
                out.append((W, *done[owed]))
                owed += 1
        out += [(W, mb, chunk) for mb, chunk in done[owed:]]
        order.append(out)
    return order


def _zb_v(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble): chunk 0 = stage r, chunk 1 = stage
    2 pp - 1 - r. Warm-up 2(pp - r) - 1 forwards of chunk 0, then r pairs (F of chunk 1, F of chunk 0),
    then pp - r triples F I W of chunk 1; the steady state alternates F I W of chunk 0 with F I W of chunk
    1; the cool-down runs r pairs of I, then pp - r (I, W) of chunk 0 and the W still owed. Built for
    max(m, 2 pp - 1) micro-batches, the ones beyond m dropped (fewer micro-batches only leave gaps)."""
    n = max(m, 2 * pp - 1)
    return [[a for a in _zb_v_rank(pp, n, rank) if a[1] < m] for rank in range(pp)]


def _zb_v_rank(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """ZB-V's order on ``rank`` for ``n >= 2 pp - 1`` micro-batches."""
    seq: list[tuple[str, int, int]] = []
    count = {(k, c): 0 for k in (F, I, W) for c in (0, 1)}

    def act(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            seq.append((kind, count[(kind, chunk)], chunk))
            count[(kind, chunk)] += 1

    f0, f1, i0, i1, w0, w1 = (F, 0), (F, 1), (I, 0), (I, 1), (W, 0), (W, 1)
    for _ in range(2 * (pp - rank) - 1):
        act(f0)
    for _ in range(rank):
        act(f1, f0)
    for _ in range(pp - rank):
        act(f1, i1, w1)
    while count[f1] < count[f0] or count[f0] < n:
        act(*([f0] if count[f0] < n else []), i0, w0, f1, i1, w1)
    for _ in range(rank):
        act(i0, i1)
    for _ in range(pp - rank):
        act(i0, w0)
    for chunk in (1, 0):
        while count[(W, chunk)] < count[(I, chunk)]:
            act((W, chunk))
    return seq


def _dualpipe_v(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, as torch's ScheduleDualPipeV orders it), V placement.
    Per rank r: 2(pp - r - 1) forwards of chunk 0; r + 1 pairs F0 F1; pp - r - 1 of (I1, a W owed, F1);
    the main phase, m - 2 pp + r + 1 times (F0, B1) then (F1, B0): the pairs whose forward and full
    backward DualPipe overlaps; pp - r - 1 of (B1, then F1 B0); r + 1 of (B1, B0), the second half split
    (I, W deferred); pp - r - 1 of (a W owed, B0); then the W still owed. Needs m >= 2 pp."""
    return [_dualpipe_v_rank(pp, m, rank) for rank in range(pp)]


def _dualpipe_v_rank(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """DualPipeV's order on ``rank``."""
    seq: list[tuple[str, int, int]] = []
    nxt = {(k, c): 0 for k in (F, B) for c in (0, 1)}  # B counts the backwards, full or split
    owed: list[tuple[int, int]] = []

    def fwd(chunk: int) -> None:
        seq.append((F, nxt[(F, chunk)], chunk))
        nxt[(F, chunk)] += 1

    def bwd(chunk: int, split: bool) -> None:
        mb = nxt[(B, chunk)]
        nxt[(B, chunk)] += 1
        seq.append((I if split else B, mb, chunk))
        if split:
            owed.append((mb, chunk))

    def weight() -> None:
        if owed:
            seq.append((W, *owed.pop(0)))

    for _ in range(2 * (pp - rank - 1)):
        fwd(0)
    for _ in range(rank + 1):
        fwd(0)
        fwd(1)
    for _ in range(pp - rank - 1):
        bwd(1, True)
        weight()
        fwd(1)
    for _ in range(m - 2 * pp + rank + 1):
        fwd(0)
        bwd(1, False)
        fwd(1)
        bwd(0, False)
    for _ in range(pp - rank - 1):
        bwd(1, False)
        fwd(1)
        bwd(0, False)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        bwd(1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        bwd(0, split)
    for _ in range(pp - rank - 1):
        weight()
        bwd(0, split)
    while owed:
        weight()
    return seq


def transfers_in_order(schedule: Schedule) -> bool:
    """True when every rank posts its sends to a peer in the order that peer posts the matching receives
    (what NCCL needs: it matches point-to-point transfers between two ranks by order, not by tag)."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.peer is None:
                continue
            stage = schedule.stage(rank, a.chunk)
            if a.kind in (SEND_F, SEND_B):
                dst = stage + 1 if a.kind == SEND_F else stage - 1
                sent.setdefault((rank, a.peer), []).append((a.kind[-1], a.microbatch, dst))
            else:
                received.setdefault((a.peer, rank), []).append((a.kind[-1], a.microbatch, stage))
    return sent == received


_GENERATORS: dict[str, Callable[[int, int, int], list[list[tuple[str, int, int]]]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved_1f1b": _interleaved,
    "zb_h1": _zb_h1,
    "zb_v": _zb_v,
    "dualpipe_v": _dualpipe_v,
    "interleaved_zb": _interleaved_zb,
}


def build_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The action lists of schedule ``name`` (one of SCHEDULES) for ``pp`` ranks."""
    if name not in _GENERATORS:
        raise ConfigError(f"parallel.schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise ConfigError(
            f"the number of micro-batches per step must be at least 1; got {num_microbatches} "
            "(it is train.global_batch_size / (train.micro_batch_size * dp))"
        )
    for problem in (
        schedule_problem(name, pp, virtual_stages),
        microbatch_problem(name, pp, num_microbatches, virtual_stages),
    ):
        if problem:
            raise ConfigError(problem)
    order = _GENERATORS[name](pp, num_microbatches, virtual_stages)
    v_shape = name in V_SCHEDULES
    actions = _with_transfers(pp, virtual_stages, order, v_shape)
    return Schedule(name, pp, num_microbatches, virtual_stages, actions, v_shape)
