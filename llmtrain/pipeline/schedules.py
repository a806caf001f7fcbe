"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it performs in one step.

Pure Python (no torch): the planner imports this to evaluate thousands of layouts quickly.

Layout. The model is cut into ``pp * virtual_stages`` consecutive stages; rank ``r`` holds the local chunks
``c = 0 .. v-1``, chunk ``c`` being global stage ``c * pp + r`` (Megatron's interleaved layout, so with
``v = 1`` rank ``r`` simply holds stage ``r``).

Actions. ``F`` forward, ``B`` full backward, or for zero-bubble schedules ``I`` (input gradient, what the
previous stage waits for) and ``W`` (weight gradient, deferrable). Each compute action is surrounded by the
transfers it implies: ``RECV_F`` (the input activation) right before a forward of a stage > 0, ``SEND_F``
right after a forward of a stage below the last, ``RECV_B`` (the output gradient) right before a
backward/``I`` of a stage below the last, ``SEND_B`` right after a backward/``I`` of a stage > 0.
Transfers between chunks on the same rank (``pp = 1``) are local and get no actions. Consecutive transfers
form one batch for the executor (e.g. Megatron's ``send_forward_recv_backward``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmtrain.config.errors import ConfigError

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 - the names used in the zero-bubble paper
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_KINDS = (F, B, I, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


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

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W actions (zero-bubble schedules)."""
        return any(a.kind == I for rank in self.actions for a in rank)

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage index held by ``rank`` as local ``chunk``."""
        return chunk * self.pp + rank

    def location(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding global ``stage``."""
        return stage % self.pp, stage // self.pp

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


def _with_transfers(pp: int, v: int, order: list[list[tuple[str, int, int]]]) -> list[list[Action]]:
    """Surround each compute action by the sends and receives it implies (see module docstring)."""
    last = pp * v - 1
    out: list[list[Action]] = []
    for rank, computes in enumerate(order):
        acts: list[Action] = []
        for kind, mb, chunk in computes:
            stage = chunk * pp + rank
            prev_rank, next_rank = (stage - 1) % pp, (stage + 1) % pp
            remote = pp > 1
            if kind == F and stage > 0 and remote:
                acts.append(Action(RECV_F, mb, chunk, prev_rank))
            if kind in (B, I) and stage < last and remote:
                acts.append(Action(RECV_B, mb, chunk, next_rank))
            acts.append(Action(kind, mb, chunk))
            if kind == F and stage < last and remote:
                acts.append(Action(SEND_F, mb, chunk, next_rank))
            if kind in (B, I) and stage > 0 and remote:
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


def _interleaved(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, warm-up
    2*(pp-rank-1) + (v-1)*pp forwards (more when m % pp != 0), backwards visiting chunks in reverse."""
    if v == 1:
        return _one_f_one_b(pp, m, v)
    if m < pp:
        raise ConfigError(
            f"interleaved_1f1b needs at least parallel.pp={pp} micro-batches per step; got {m}. Raise "
            f"train.global_batch_size / (train.micro_batch_size * dp) to >= {pp}, lower parallel.pp, or use "
            "parallel.schedule=1f1b with parallel.virtual_stages=1"
        )
    groups = _interleaved_groups(m, pp)
    # Forwards run group by group through every chunk; the backward of chunk v-1-c follows that of c, so a
    # rank must run ahead by (v-1) * the largest group, plus the 2*(pp-rank-1) of the round trip.
    table = [(mb, c) for g in groups for c in range(v) for mb in g]
    largest = max(len(g) for g in groups)
    total = m * v
    order = []
    for rank in range(pp):
        warmup = min(2 * (pp - rank - 1) + (v - 1) * largest, total)
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
}


def build_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The action lists of schedule ``name`` (gpipe | 1f1b | interleaved_1f1b | zb_h1) for ``pp`` ranks."""
    if name not in _GENERATORS:
        raise ConfigError(f"parallel.schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ConfigError(f"parallel.pp must be at least 1; got {pp}")
    if num_microbatches < 1:
        raise ConfigError(
            f"the number of micro-batches per step must be at least 1; got {num_microbatches} "
            "(it is train.global_batch_size / (train.micro_batch_size * dp))"
        )
    if virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages must be at least 1; got {virtual_stages}")
    if virtual_stages > 1 and name != "interleaved_1f1b":
        raise ConfigError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.schedule=interleaved_1f1b "
            f"(got {name}); set virtual_stages=1 or change the schedule"
        )
    order = _GENERATORS[name](pp, num_microbatches, virtual_stages)
    return Schedule(name, pp, num_microbatches, virtual_stages, _with_transfers(pp, virtual_stages, order))
