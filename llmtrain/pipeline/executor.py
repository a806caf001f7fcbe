"""Running a pipeline schedule for real: the actions of ``schedules.py`` with point-to-point transfers.

The executor walks this rank's action list in order. Before each compute it posts (on NCCL in one
``torch.distributed.batch_isend_irecv``) the sends of the previous compute and the receives of the next
``lookahead`` computes (so transfers overlap compute), then waits for the receives this compute needs.
Sends are waited for only at the end of the step, so a send never blocks the sender: the simulator's model,
under which every schedule is checked deadlock-free. Every transfer carries its own tag, so a receive
matches its send whatever order the two ranks post them in (gloo); NCCL matches by order, so there the
executor checks ``transfers_in_order`` and posts nothing early. Shapes are fixed ahead
(``activation_shape``): no handshakes.

Gradients accumulate over the micro-batches; the loss is the mean over micro-batches of each micro-batch's
mean loss, exactly as ``LocalStepRunner`` on one process. With a split backward (zero-bubble schedules) the
``I`` action computes input gradients and keeps each linear layer's (input, output-gradient) pair -- plain
``nn.Linear`` and the tensor-parallel column/row layers alike; ``W`` turns them into weight gradients later.
A forward followed by a full backward that both exchange tokens over EP (DualPipeV's overlapped phase on an
MoE model) run as a pair on two threads taking turns at the all-to-alls (llmtrain.parallel.turns): both
computes' receives are waited for first, the sends between them posted after both. The backward's
all-to-alls take turns too where autograd runs it on a device thread of its own (GPUs; emulated on CPU in
the tests, not yet run on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.layout_rules import V_SCHEDULES
from llmtrain.config.schema import JobConfig
from llmtrain.models.moe import RouterFigures
from llmtrain.parallel import comm
from llmtrain.parallel.fsdp import finish_backward, is_fsdp
from llmtrain.parallel.materialize import is_meta, materialize
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.turns import backward_elsewhere, recording, run_pair
from llmtrain.parallel.zero import apply_data_parallel, grad_sync
from llmtrain.pipeline.comm_trace import CommTrace, collective_events
from llmtrain.pipeline.router_stats import PipelineRouter
from llmtrain.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    I,
    Schedule,
    W,
    build_schedule,
    transfers_in_order,
)
from llmtrain.pipeline.split_backward import SplitBackward, accumulate, defer_weight_grads
from llmtrain.pipeline.stages import PipelineStages, activation_shape, build_stages
from llmtrain.precision import torch_dtype


def _mixed_backward(actions: Sequence[Action]) -> bool:
    """True when a chunk runs both full backwards (B) and split ones (I, W) in ``actions``."""
    kinds: dict[int, set[bool]] = {}
    for a in actions:
        if a.kind in (B, I):
            kinds.setdefault(a.chunk, set()).add(a.kind == B)
    return any(len(k) > 1 for k in kinds.values())


def _shared_across_chunks(stages: PipelineStages) -> bool:
    """True when two chunks of ``stages`` hold the same parameter (a tied embedding at both ends of a V)."""
    owners: dict[int, int] = {}
    for c, chunk in enumerate(stages.chunks):
        for p in chunk.parameters():
            if owners.setdefault(id(p), c) != c:
                return True
    return False


class PipelineExecutor:
    """Runs ``schedule`` on this rank's ``stages``: forward and backward of one step, no optimizer step."""

    def __init__(
        self,
        stages: PipelineStages,
        schedule: Schedule,
        topo: Topology,
        activation_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        lookahead: int = 2,
    ) -> None:
        placed = [schedule.stage(topo.pp_rank, c) for c in range(len(stages.chunks))]
        if placed != [chunk.stage for chunk in stages.chunks]:
            raise ValueError(
                f"schedule {schedule.name} places stages {placed} on pipeline rank {topo.pp_rank} but its "
                f"chunks hold {[chunk.stage for chunk in stages.chunks]}; build the stages with "
                "v_shape=True for a V schedule (build_pipeline does)"
            )
        if schedule.pp != topo.pp or len(stages.chunks) != schedule.virtual_stages:
            raise ValueError(
                f"schedule {schedule.name} is for pp={schedule.pp}, v={schedule.virtual_stages} but the "
                f"topology has pp={topo.pp} and this rank holds {len(stages.chunks)} chunks; build both from "
                "the same parallel.pp / parallel.virtual_stages"
            )
        self.stages = stages
        self.schedule = schedule
        self.topo = topo
        self.activation_shape = tuple(activation_shape)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else next(stages.parameters()).device
        self.actions = schedule.actions[topo.pp_rank]
        # Receives posted this many computes early; NCCL completes a batch as one, so it posts none early.
        nccl = topo.pp > 1 and dist.get_backend(topo.pp_group) == "nccl"
        self.lookahead = 0 if nccl else lookahead
        self.coalesce_transfers = nccl
        if nccl and not transfers_in_order(schedule):
            raise ValueError(
                f"{schedule.name} with pp={schedule.pp}, {schedule.num_microbatches} micro-batches and "
                f"v={schedule.virtual_stages} posts transfers between two ranks in different orders, which "
                "NCCL cannot match; use a number of micro-batches that is a multiple of parallel.pp"
            )
        self.trace: list[dict] | None = None
        self.comm_trace: list[dict] | None = None
        """A traced run's transfers (llmtrain.pipeline.comm_trace.CommEvent fields); None on NCCL, whose
        batches complete as one."""
        self.collective_trace: list[dict] | None = None
        """A traced run's EP all-to-alls (CommEvent fields: kind, microbatch and chunk those of the compute
        that issued it, posted when issued, needed when its wait began, done when that returned)."""
        self._loss_scale = 1.0
        # The actions that complete a chunk's gradients: data-parallel reduction runs with them. Flat
        # buffers (zero 0/1) reduce each parameter once its last gradient is in, so the last action of each
        # kind counts (I and W fill different parameters). FSDP2 reduces a whole unit (a block: norms filled
        # by I, linear weights by W) in the post-backward hook of the unit's autograd backward; under a split
        # backward that is I's, before the deferred W. So with FSDP only the chunk's last action, a W,
        # synchronises: every W ends as the backward it was split from would (fsdp.finish_backward), which
        # there reduce-scatters every unit once the last weight gradient is in, and elsewhere folds the
        # low-precision weight gradients into FSDP's fp32 accumulators, as each I does. Flat buffers count
        # one arrival per parameter, so where a parameter's gradient comes from two kinds of the last
        # actions -- a chunk running both B and I/W (dualpipe_v), or a weight shared by two chunks of this
        # rank (a tied embedding at both ends of a V) -- no action synchronises: the optimizer's finish
        # launches every bucket at the step's end.
        self._fsdp = is_fsdp(stages)
        self._final: set[Action] = set()
        seen: set[tuple[str, int] | int] = set()
        for a in reversed(self.actions):
            scope = a.chunk if self._fsdp else (a.kind, a.chunk)
            if a.kind in (B, I, W) and scope not in seen:
                seen.add(scope)
                self._final.add(a)
        if not self._fsdp and (_mixed_backward(self.actions) or _shared_across_chunks(stages)):
            self._final = set()
        if topo.pp == 1 and schedule.virtual_stages > 1:
            raise ValueError(
                "parallel.virtual_stages > 1 needs parallel.pp > 1 (chunks hand activations to the next rank)"
            )
        self._split = SplitBackward()
        # A mixture of experts' router losses and figures span the stages (llmtrain.pipeline.router_stats).
        self.router = PipelineRouter(stages.chunks, topo) if stages.chunks[0].num_moe_layers else None
        self.router_figures: RouterFigures | None = None
        """The last training run's RouterFigures (every MoE layer's, every rank); None for a dense model."""
        self.mtp_losses: torch.Tensor | None = None
        """The last training run's multi-token prediction cross-entropy per depth (mean over micro-batches,
        (D,), every rank); None without model.mtp_layers."""
        if schedule.split_backward:
            defer_weight_grads(self._split, self.stages.chunks)
        # DualPipeV's overlapped pairs: a forward and the next backward both exchanging tokens over EP run on
        # two threads taking turns at the all-to-alls (llmtrain.parallel.turns), so each exchange hides behind
        # the other's compute. FSDP's unsharding stays on one thread. Other schedules' F-then-B steps (1F1B's
        # steady state) are not paired: their pairing is neither checked deadlock-free nor tested.
        moe = any(c.num_moe_layers for c in stages.chunks)
        self.overlap = schedule.name == "dualpipe_v" and topo.ep > 1 and not self._fsdp and moe
        """Run overlapped pairs on two threads (default for dualpipe_v where they exchange tokens over EP)."""

    def _global(self, pp_rank: int) -> int:
        return self.topo.rank_of(pp_rank=pp_rank)

    def _tag(self, a: Action, stage_to: int) -> int:
        # Unique per (direction, micro-batch, receiving stage) within a step.
        direction = 0 if a.kind in (SEND_F, RECV_F) else 1
        return (a.microbatch * self.schedule.num_stages + stage_to) * 2 + direction

    def _send_op(self, t: Action, outputs: dict, inputs: dict) -> dist.P2POp:
        """The isend of a SEND_F (this chunk's output) or SEND_B (the gradient of its input)."""
        stage = self.schedule.stage(self.topo.pp_rank, t.chunk)
        key = (t.microbatch, t.chunk)
        if t.kind == SEND_F:
            tensor, stage_to = outputs[key].detach(), stage + 1
        else:
            tensor, stage_to = inputs.pop(key).grad, stage - 1
        # Sequence-parallel activations are views moved out of a reduce-scatter; gloo sends contiguous memory.
        return dist.P2POp(dist.isend, tensor.contiguous(), self._global(t.peer), tag=self._tag(t, stage_to))

    def run(
        self, micro_batches: Sequence[torch.Tensor], trace: bool = False, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch ((b, s+1) token ids: inputs [:, :-1], labels [:, 1:]);
        returns the mean loss (0-d fp32 tensor, on every pipeline rank). ``trace`` records per-action
        start/end times in ``self.trace`` (the format of ``timeline.load_trace``), each transfer's posted,
        done and waited times in ``self.comm_trace`` and each EP all-to-all's in ``self.collective_trace``;
        ``loss_scale`` multiplies the loss before backward
        (fp16)."""
        self._loss_scale = loss_scale
        return self._run(micro_batches, forward_only=False, trace=trace)

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Mean loss without gradients: the schedule's forwards only."""
        return self._run(micro_batches, forward_only=True, trace=False)

    def _run(self, micro_batches: Sequence[torch.Tensor], forward_only: bool, trace: bool) -> torch.Tensor:
        s = self.schedule
        m = s.num_microbatches
        if len(micro_batches) != m:
            raise ValueError(
                f"the schedule has {m} micro-batches per step but run() got {len(micro_batches)}; "
                "build the schedule with the number of micro-batches per step"
            )
        pp_rank = self.topo.pp_rank
        chunks = self.stages.chunks
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations (and their grads)
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs (loss on the last stage)
        grads_in: dict[tuple[int, int], torch.Tensor] = {}  # received output gradients
        deferred: dict[tuple[int, int], list] = {}
        pending_sends: list[Any] = []
        losses: list[torch.Tensor] = []
        depths: list[torch.Tensor] = []  # multi-token prediction's cross-entropy per depth, per micro-batch
        self.trace = [] if trace else None
        self.collective_trace = [] if trace else None
        comms = CommTrace(pp_rank) if trace and not self.coalesce_transfers else None
        router = None if forward_only else self.router
        if router is not None:
            router.start(self._loss_scale / m)
        actions = (
            [a for a in self.actions if a.kind in ("F", SEND_F, RECV_F)] if forward_only else self.actions
        )
        computes = [i for i, a in enumerate(actions) if a.is_compute]
        ops: list[dist.P2POp] = []
        op_action: list[int] = []  # the action index of each op (a send's or a receive's)
        recv_bufs: dict[int, torch.Tensor] = {}
        recv_works: dict[int, Any] = {}
        posted = 0  # receives of actions[:posted] are posted

        def post_receives(limit: int) -> None:
            nonlocal posted
            for j in range(posted, limit):
                a = actions[j]
                if a.kind in (RECV_F, RECV_B):
                    buf = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                    ops.append(
                        dist.P2POp(dist.irecv, buf, self._global(a.peer), tag=self._tag(a, a_stage(a)))
                    )
                    op_action.append(j)
                    recv_bufs[j] = buf
            posted = max(posted, limit)

        def queue_sends(start: int, stop: int) -> None:
            for j in range(start, stop):
                if actions[j].kind in (SEND_F, SEND_B):
                    ops.append(self._send_op(actions[j], outputs, inputs))
                    op_action.append(j)

        def flush() -> None:
            if not ops:
                return
            if self.coalesce_transfers:
                works = dist.batch_isend_irecv(list(ops))
            else:
                # gloo: one work per op either way; plain isend/irecv skip batch_isend_irecv's coalescing
                # bookkeeping (0.5 vs 0.33 ms per exchange of one activation, measured).
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
            if len(works) == len(ops):
                for index, work in zip(op_action, works, strict=True):
                    if comms is not None:
                        comms.posted(index, actions[index])
                    if actions[index].kind in (SEND_F, SEND_B):
                        pending_sends.append((index, work))
                    else:
                        recv_works[index] = work
            else:
                # Coalesced (NCCL): the batch completes as one.
                for work in works:
                    work.wait()
            ops.clear()
            op_action.clear()

        def a_stage(a: Action) -> int:
            return s.stage(pp_rank, a.chunk)

        def take_receives(start: int, stop: int) -> None:
            """Wait for the receives among actions[start:stop] and file their buffers."""
            for j in range(start, stop):
                t = actions[j]
                if t.kind in (RECV_F, RECV_B):
                    work = recv_works.pop(j, None)
                    if work is not None:
                        detail = f"{t.kind} mb={t.microbatch} chunk={t.chunk} from pp rank {t.peer}"
                        with self.topo.watchdog.waiting("pp", "recv", detail, peer=self._global(t.peer)):
                            if comms is not None:
                                comms.wait(j, work)
                            else:
                                work.wait()
                    store = inputs if t.kind == RECV_F else grads_in
                    store[(t.microbatch, t.chunk)] = recv_bufs.pop(j)

        def compute(a: Action) -> None:
            key = (a.microbatch, a.chunk)
            local = self._local_neighbour(a)
            if local is not None and a.kind == "F":  # the V's bottom turn: the input is on this rank
                inputs[key] = outputs[(a.microbatch, local)].detach()
            start = time.perf_counter()
            chunk = chunks[a.chunk]
            self._split.building = s.split_backward and a.kind in ("F", I)
            collectives: list[tuple[float, float, float]] = []  # its EP all-to-alls, when traced
            try:
                with recording(collectives) if self.trace is not None else contextlib.nullcontext():
                    if a.kind == "F":
                        out = self._forward(chunk, micro_batches[a.microbatch], inputs.get(key), forward_only)
                        if router is not None:
                            out = router.after_forward(chunk, a.microbatch, out)
                        if chunk.is_last:
                            losses.append(out.detach().float())
                            if chunk.mtp is not None and not forward_only:
                                depths.append(chunk.mtp.last_losses)
                        outputs[key] = out
                    else:
                        with self._grad_sync(a):
                            if a.kind == W:
                                accumulate(deferred.pop(key))
                                if self._fsdp:
                                    finish_backward(chunk)
                            else:
                                self._backward(a, key, chunk, outputs, grads_in, deferred, m)
                                if local is not None:  # the input's gradient, for the previous chunk here
                                    grads_in[(a.microbatch, local)] = inputs.pop(key).grad
            finally:
                self._split.building = False
            if self.trace is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.trace.append(
                    {
                        "rank": pp_rank,
                        "kind": a.kind,
                        "microbatch": a.microbatch,
                        "chunk": a.chunk,
                        "start": start,
                        "end": time.perf_counter(),
                    }
                )
                self.collective_trace += collective_events(pp_rank, a, collectives)

        previous = -1
        k = 0
        while k < len(computes):
            i = computes[k]
            a = actions[i]
            # An overlapped pair (a forward, then a backward, both exchanging tokens between EP ranks) runs
            # as one: both computes' receives first, the sends between them after both.
            paired = (
                not forward_only and k + 1 < len(computes) and self._overlaps(a, actions[computes[k + 1]])
            )
            last = computes[k + 1] if paired else i
            # The transfers between the previous compute and this one: its sends, this one's receives.
            queue_sends(previous + 1, i)
            # Receives are posted `lookahead` computes ahead, so transfers overlap compute.
            ahead = k + paired + self.lookahead
            post_receives(max(last, computes[ahead] if ahead < len(computes) else len(actions)))
            flush()
            take_receives(previous + 1, last)
            if paired:
                run_pair(functools.partial(compute, a), functools.partial(compute, actions[last]))
                queue_sends(i + 1, last)
            else:
                compute(a)
            previous = last
            k += 1 + paired
        queue_sends(previous + 1, len(actions))
        flush()
        with self.topo.watchdog.waiting("pp", "send", f"{len(pending_sends)} sends at the end of the step"):
            for index, work in pending_sends:
                if comms is not None:
                    comms.wait(index, work)
                else:
                    work.wait()
        self.comm_trace = comms.events if comms is not None else None
        if not forward_only:
            self.stages.sync_tied_grads()
        loss = self._mean_loss(losses, depths, m, forward_only)
        if router is None:
            return loss
        terms, self.router_figures = router.finish(m)
        return loss + terms.cpu()

    def _overlaps(self, a: Action, b: Action) -> bool:
        """True when forward ``a`` and the backward ``b`` after it run as an overlapped pair."""
        chunks = self.stages.chunks
        moe = chunks[a.chunk].num_moe_layers and chunks[b.chunk].num_moe_layers
        return self.overlap and a.kind == "F" and b.kind == B and bool(moe)

    def _local_neighbour(self, a: Action) -> int | None:
        """The chunk of this rank holding the stage before ``a``'s (the bottom of a V), whose output a
        forward takes and to which a backward hands its input's gradient without a transfer; else None."""
        s = self.schedule
        stage = s.stage(self.topo.pp_rank, a.chunk)
        if a.kind == W or stage == 0 or self.topo.pp == 1:
            return None
        rank, chunk = s.location(stage - 1)
        return chunk if rank == self.topo.pp_rank else None

    def _forward(
        self, chunk: nn.Module, micro: torch.Tensor, received: torch.Tensor | None, forward_only: bool
    ) -> torch.Tensor:
        """One chunk's forward of one micro-batch: its output, or the loss on the last stage."""
        micro = micro.to(self.device)
        if chunk.is_first:
            x = micro[:, :-1]
        else:
            x = received
            if not forward_only:
                x.requires_grad_()
        return chunk(x, micro[:, 1:]) if chunk.is_last else chunk(x)

    def _backward(
        self,
        a: Action,
        key: tuple[int, int],
        chunk: nn.Module,
        outputs: dict,
        grads_in: dict,
        deferred: dict,
        m: int,
    ) -> None:
        """Full backward (B) or input-gradient part (I) of one chunk for one micro-batch."""
        out = outputs.pop(key)
        if a.kind == I:
            self._split.queue = deferred.setdefault(key, [])
        try:
            # Inside an overlapped pair the all-to-alls of a backward that autograd runs on its device's
            # thread (GPUs) hand off for this side (llmtrain.parallel.turns.backward_elsewhere).
            with backward_elsewhere(), self._split.in_backward():
                if chunk.is_last:
                    # The step's loss is the mean over micro-batches, as on one process.
                    torch.autograd.backward(out * (self._loss_scale / m))
                else:
                    torch.autograd.backward(out, grads_in.pop(key))
        finally:
            self._split.queue = None

    @contextlib.contextmanager
    def _grad_sync(self, a: Action) -> Iterator[None]:
        """Data-parallel gradient reduction only with the last gradient-producing action of a chunk."""
        with grad_sync(self.stages, a in self._final):
            yield

    def _mean_loss(
        self, losses: list[torch.Tensor], depths: list[torch.Tensor], m: int, forward_only: bool
    ) -> torch.Tensor:
        """The mean loss over micro-batches, broadcast from the last pipeline stage; in training with
        multi-token prediction its mean cross-entropy per depth too, as `mtp_losses` on every rank."""
        d = 0 if forward_only else self.stages.chunks[0].shell.config.mtp_layers
        value = torch.zeros(1 + d, dtype=torch.float32, device=self.device)
        if losses:
            value[0] = torch.stack(losses).sum() / m
        if depths:
            value[1:] = torch.stack(depths).float().mean(0)
        if self.topo.pp > 1:
            last = self._global(self.schedule.location(self.schedule.num_stages - 1)[0])
            comm.broadcast(value, src=last, group=self.topo.pp_group, detail="loss from the last stage")
        # On NCCL the broadcast returns at once; a stage that never sends shows at this host sync.
        with self.topo.watchdog.waiting("pp", "host sync", "loss from the last stage"):
            value = value.cpu()
        if d:
            self.mtp_losses = value[1:]
        return value[0]


class PipelineStepRunner:
    """The trainer's StepRunner for pipeline-parallel jobs: one global-batch slice per executor step."""

    def __init__(self, executor: PipelineExecutor, optimizer: Any, micro_batch_size: int) -> None:
        self.executor = executor
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size

    @property
    def router_figures(self) -> RouterFigures | None:
        """The last train_step's RouterFigures (every MoE layer's); None for a dense model."""
        return self.executor.router_figures

    @property
    def mtp_losses(self) -> torch.Tensor | None:
        """The last train_step's multi-token prediction cross-entropy per depth; None without it."""
        return self.executor.mtp_losses

    def train_step(self, batch: torch.Tensor, timer: Any) -> torch.Tensor:
        """Accumulate gradients over the micro-batches of ``batch``; the mean loss (0-d)."""
        self.executor.stages.train()
        scale = getattr(self.optimizer, "loss_scale", None) or 1.0
        # Forward, backward and pipeline waits interleave within a schedule: timed as one section.
        with timer.section("pipeline"):
            return self.executor.run(list(batch.split(self.micro_batch_size)), loss_scale=scale)

    def eval_step(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean loss of ``batch`` without gradients."""
        self.executor.stages.eval()
        return self.executor.evaluate(list(batch.split(self.micro_batch_size)))


def build_pipeline(
    model: nn.Module, topo: Topology, job: JobConfig, head_cost: float = 0.0
) -> tuple[PipelineStages, PipelineExecutor]:
    """This rank's chunks of a (tensor-parallel) model and the executor of ``job.parallel.schedule``; hand
    the stages to build_optimizer and both to PipelineStepRunner. ``head_cost``: the output layer's cost
    in layers, which the split balances against (0: an even split). A meta ``model`` is materialised here,
    once only this rank's chunks are left (llmtrain.parallel.materialize); at zero_stage 2/3 the chunks are
    sharded by FSDP2 first, so only this rank's shards of them are."""
    p, t = job.parallel, job.train
    stages = build_stages(
        model,
        topo,
        p.virtual_stages,
        head_cost=head_cost,
        sequence_parallel=p.sequence_parallel,
        stage_layers=p.stage_layers,
        v_shape=p.schedule in V_SCHEDULES,
    )
    if p.zero_stage >= 2:  # FSDP2 shards the meta stages: materialize then allocates only this rank's shards
        apply_data_parallel(stages, topo, job)
    if is_meta(stages):
        materialize(stages, topo, job.model, t.seed, topo.device)
    per_rank = t.global_batch_size // topo.dp
    schedule = build_schedule(p.schedule, topo.pp, per_rank // t.micro_batch_size, p.virtual_stages)
    shape = activation_shape(t.micro_batch_size, job.model.seq_length, job.model.hidden_size, topo.tp,
                             p.sequence_parallel, topo.cp)  # fmt: skip
    return stages, PipelineExecutor(stages, schedule, topo, shape, torch_dtype(t.precision))
