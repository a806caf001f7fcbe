"""Running a pipeline schedule for real: the actions of ``schedules.py`` with point-to-point transfers.

The executor walks this rank's action list in order. Consecutive transfer actions are posted together with
``torch.distributed.batch_isend_irecv``; receives are waited for at once (the next compute needs them),
sends only at the end of the step, so a send never blocks the sender (the simulator's model, under which
every schedule is checked deadlock-free). Every transfer carries its own tag, so a receive matches its send
whatever order the two ranks post them in. Shapes are fixed ahead (``activation_shape``): no handshakes.

Gradients accumulate over the micro-batches; the loss is the mean over micro-batches of each micro-batch's
mean loss, exactly as ``LocalStepRunner`` on one process. With a split backward (zero-bubble schedules) the
``I`` action computes input gradients and keeps each Linear's (input, output-gradient) pair; ``W`` turns
them into weight gradients later.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmtrain.parallel.data_parallel import grad_sync
from llmtrain.parallel.topology import Topology
from llmtrain.pipeline.schedules import RECV_F, SEND_B, SEND_F, Action, B, I, Schedule, W
from llmtrain.pipeline.stages import PipelineStages

# Weight-gradient work deferred by the current I action: None outside of one.
_deferred: list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]] | None = None


class _DeferrableLinear(torch.autograd.Function):
    """F.linear whose weight/bias gradients are queued while an I action runs (computed at once otherwise).

    The parameters enter detached, so autograd's own graph has no edge to them (their gradient hooks must
    run once, when the gradient really arrives); ``params`` are the real leaves.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: tuple
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        work = (ctx.params[0], ctx.params[1], x, grad)
        if _deferred is not None:
            _deferred.append(work)
        else:
            _run_weight_grads([work])
        return grad_x, None, None, None


def _deferrable_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = self.bias.detach() if self.bias is not None else None
    return _DeferrableLinear.apply(x, self.weight.detach(), bias, (self.weight, self.bias))


def _run_weight_grads(
    work: list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]],
) -> None:
    """Accumulate queued Linear weight/bias gradients through autograd, so gradient hooks (DP buckets) run."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for weight, bias, x, grad in work:
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        params.append(weight)
        grads.append(g2.t().matmul(x2))
        if bias is not None:
            params.append(bias)
            grads.append(g2.sum(0))
    if params:
        torch.autograd.backward(params, grads)


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
    ) -> None:
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
        self.trace: list[dict] | None = None
        # The last action that adds to each chunk's gradients: data-parallel reduction runs with it.
        self._final: set[Action] = set()
        seen: set[tuple[str, int]] = set()
        for a in reversed(self.actions):
            if a.kind in (B, I, W) and (a.kind, a.chunk) not in seen:
                seen.add((a.kind, a.chunk))
                self._final.add(a)
        if topo.pp == 1 and schedule.virtual_stages > 1:
            raise ValueError(
                "parallel.virtual_stages > 1 needs parallel.pp > 1 (chunks hand activations to the next rank)"
            )
        if schedule.split_backward:
            # Defer the weight gradients of plain Linear layers; a weight shared with another module (a
            # tied head) keeps its gradient in I so each parameter gets it from one kind of action only.
            uses: dict[int, int] = {}
            for chunk in stages.chunks:
                for module in chunk.modules():
                    for p in module.parameters(recurse=False):
                        uses[id(p)] = uses.get(id(p), 0) + 1
            for chunk in stages.chunks:
                for module in chunk.modules():
                    if type(module) is nn.Linear and uses[id(module.weight)] == 1:
                        module.forward = types.MethodType(_deferrable_forward, module)

    def _global(self, pp_rank: int) -> int:
        return self.topo.rank_of(pp_rank=pp_rank)

    def _tag(self, a: Action, stage_to: int) -> int:
        # Unique per (direction, micro-batch, receiving stage) within a step.
        direction = 0 if a.kind in (SEND_F, RECV_F) else 1
        return (a.microbatch * self.schedule.num_stages + stage_to) * 2 + direction

    def run(self, micro_batches: Sequence[torch.Tensor], trace: bool = False) -> torch.Tensor:
        """Forward and backward of every micro-batch ((b, s+1) token ids: inputs [:, :-1], labels [:, 1:]);
        returns the mean loss (0-d fp32 tensor, on every pipeline rank). ``trace`` records per-action
        start/end times in ``self.trace`` (the format of ``timeline.load_trace``)."""
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
        self.trace = [] if trace else None
        batch: list[dist.P2POp] = []
        recv_slots: list[tuple[dict, tuple[int, int], torch.Tensor]] = []

        def flush() -> None:
            if not batch:
                return
            works = dist.batch_isend_irecv(list(batch))
            for op, work in zip(batch, works, strict=True):
                if op.op is dist.isend:
                    pending_sends.append(work)
                else:
                    work.wait()
            for store, key, tensor in recv_slots:
                store[key] = tensor
            batch.clear()
            recv_slots.clear()

        actions = (
            [a for a in self.actions if a.kind in ("F", SEND_F, RECV_F)] if forward_only else self.actions
        )
        for a in actions:
            key = (a.microbatch, a.chunk)
            stage = s.stage(pp_rank, a.chunk)
            if a.is_comm:
                peer = self._global(a.peer)
                if a.kind == SEND_F:
                    tensor = outputs[key].detach()
                    batch.append(dist.P2POp(dist.isend, tensor, peer, tag=self._tag(a, stage + 1)))
                elif a.kind == SEND_B:
                    tensor = inputs.pop(key).grad
                    batch.append(dist.P2POp(dist.isend, tensor, peer, tag=self._tag(a, stage - 1)))
                else:
                    buf = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                    batch.append(dist.P2POp(dist.irecv, buf, peer, tag=self._tag(a, stage)))
                    recv_slots.append((inputs if a.kind == RECV_F else grads_in, key, buf))
                continue
            flush()
            start = time.perf_counter()
            chunk = chunks[a.chunk]
            if a.kind == "F":
                micro = micro_batches[a.microbatch].to(self.device)
                if chunk.is_first:
                    x = micro[:, :-1]
                else:
                    x = inputs[key]
                    if not forward_only:
                        x.requires_grad_()
                out = chunk(x)
                if chunk.is_last:
                    loss = chunk.loss(out, micro[:, 1:])
                    losses.append(loss.detach().float())
                    out = loss
                outputs[key] = out
            else:
                with self._grad_sync(a):
                    if a.kind == W:
                        _run_weight_grads(deferred.pop(key))
                    else:
                        self._backward(a, key, chunk, outputs, grads_in, deferred, m)
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
        flush()
        for work in pending_sends:
            work.wait()
        if not forward_only:
            self.stages.sync_tied_grads()
        return self._mean_loss(losses, m)

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
        global _deferred
        out = outputs.pop(key)
        if a.kind == I:
            _deferred = deferred.setdefault(key, [])
        try:
            if chunk.is_last:
                # The step's loss is the mean over micro-batches, as on one process.
                torch.autograd.backward(out / m)
            else:
                torch.autograd.backward(out, grads_in.pop(key))
        finally:
            _deferred = None

    @contextlib.contextmanager
    def _grad_sync(self, a: Action) -> Iterator[None]:
        """Data-parallel gradient reduction only with the last gradient-producing action of a chunk."""
        with grad_sync(self.stages, a in self._final):
            yield

    def _mean_loss(self, losses: list[torch.Tensor], m: int) -> torch.Tensor:
        """The mean loss over micro-batches, broadcast from the last pipeline stage."""
        value = torch.stack(losses).sum() / m if losses else torch.zeros((), dtype=torch.float32)
        value = value.to(self.device)
        if self.topo.pp > 1:
            last = self._global(self.topo.pp - 1)
            dist.broadcast(value, src=last, group=self.topo.pp_group)
        return value.cpu()
