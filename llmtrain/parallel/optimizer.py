"""The model's optimizer: fp32 master weights, AdamW, loss scaling, global-norm clipping, optional ZeRO-1.

`LossScaledOptimizer` is what every data-parallel path shares (the trainer's prepare/apply/skip protocol,
fp16 loss scaling, the global gradient norm and clipping, the checkpoint's scalar state). `ModelOptimizer`
works on the flat buffers of `data_parallel.GradBuffers`: each rank updates the pieces of the buffer it
owns (everything for zero_stage 0, its 1/dp shard of every bucket for zero_stage 1). The master weights are
the parameters themselves in fp32 (no copy), an fp32 copy of the owned pieces in bf16/fp16. zero_stage 2/3
use `fsdp.FSDPOptimizer` over FSDP2's shards instead; `llmtrain.parallel.zero.build_optimizer` picks.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.parallel import comm
from llmtrain.parallel.data_parallel import GradBuffers, apply_dp, dp_options
from llmtrain.parallel.muon import MuonAdamW, flat_matrices, stage_group
from llmtrain.parallel.tensor_parallel import reduce_tp_grads
from llmtrain.parallel.topology import Topology

# Dynamic loss scaling (fp16): halve on overflow, double after this many clean steps.
_GROWTH_INTERVAL = 1000
_MIN_LOSS_SCALE = 1.0

MakeOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass
class StepStats:
    """What one optimizer step did."""

    grad_norm: float
    skipped: bool
    loss_scale: float | None


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Norm weights, biases (anything 1-d) and learned position embeddings are not decayed."""
    return param.ndim < 2 or "embed_positions" in name


def _make_adamw(groups: list[dict[str, Any]], job: JobConfig, device: torch.device) -> torch.optim.Optimizer:
    t = job.train
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    if device.type == "cuda" and importlib.util.find_spec("apex") is not None:
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(groups, adam_w_mode=True, **kwargs)
        except (ImportError, RuntimeError):
            pass  # apex without its CUDA extensions: fall back to torch's own
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def make_param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups over trainable parameters (decayed, not decayed), empty groups left out."""
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in named:
        if p.requires_grad:
            (rest if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class LossScaledOptimizer:
    """The trainer's optimizer protocol over some data-parallel layout of the gradients: ``prepare`` (finish
    the reduction, unscale, global norm), then ``apply`` (clip, update, publish) or ``skip``; fp16 dynamic
    loss scaling; the scalar state of a checkpoint. Subclasses say where the gradients are."""

    optimizer: torch.optim.Optimizer | None
    # The group the squared norms of this rank's counted gradients are summed over (None: the world),
    # and how many ranks it has (1: no communication).
    _norm_group: Any
    _norm_ranks: int

    def __init__(self, topo: Topology, job: JobConfig) -> None:
        self.topo = topo
        self.job = job
        self.precision = job.train.precision
        self.grad_clip = job.train.grad_clip
        self.loss_scale: float | None = job.train.initial_loss_scale if self.precision == "fp16" else None
        self._good_steps = 0

    def _build(
        self, groups: list[dict[str, Any]], make_optimizer: MakeOptimizer | None, device: torch.device
    ) -> torch.optim.Optimizer:
        make = make_optimizer or (lambda g: _make_adamw(g, self.job, device))
        return make(groups)

    def _grads(self) -> list[torch.Tensor]:
        """The fp32 gradients this rank updates from (local tensors, modified in place by unscaling and
        clipping)."""
        raise NotImplementedError

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradients whose squares this rank adds to the global norm (each element counted once)."""
        raise NotImplementedError

    def _finish_reduction(self) -> None:
        """Complete the data-parallel reduction and sum partial tensor-parallel gradients."""
        raise NotImplementedError

    def _publish(self) -> None:
        """After the update: make the new parameters visible to the next forward (default: nothing)."""

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the loss scale in fp16."""
        if self.loss_scale is not None:
            loss = loss * self.loss_scale
        loss.backward()

    def global_grad_norm(self) -> float:
        """L2 norm of the full gradient over every TP/PP/DP shard, each element counted once."""
        counted = self._counted_grads()
        if counted:
            sumsq = torch.stack(torch._foreach_norm(counted, 2.0)).double().pow(2).sum()
        else:
            sumsq = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        if self._norm_ranks == 1:
            return math.sqrt(sumsq.item())
        comm.all_reduce(sumsq, group=self._norm_group, detail="global gradient norm")
        group = "world" if self._norm_group is None else "mp"
        # On NCCL the all-reduce returns at once; a rank that never joins shows at this host sync.
        with self.topo.watchdog.waiting(group, "host sync", "global gradient norm"):
            return math.sqrt(sumsq.item())

    def prepare(self, inject_inf: bool = False) -> float:
        """Finish the gradient reduction and unscale; return the global gradient norm (inf or NaN when a
        gradient is not finite). Then exactly one of `apply` or `skip` ends the step; the trainer decides
        which only after every rank has reported its norm, so all ranks take the same branch.

        `inject_inf` sets one gradient element this rank counts to inf after the reduction: the `inf_grad`
        fault (llmtrain.faults), a non-finite gradient that only this rank sees."""
        self._finish_reduction()
        grads = self._grads()
        if self.loss_scale is not None and grads:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        # An FSDP shard may be empty (fewer rows than DP ranks): the first element this rank has.
        target = next((g for g in self._counted_grads() if g.numel()), None) if inject_inf else None
        if target is not None:
            target.view(-1)[0] = math.inf
        return self.global_grad_norm()

    def apply(self, lr: float, norm: float) -> StepStats:
        """Clip to train.grad_clip by `norm` (prepare's), update, and publish the new parameters."""
        scale_used = self.loss_scale
        grads = self._grads()
        if self.grad_clip > 0 and grads:
            # Same coefficient as torch.nn.utils.clip_grad_norm_.
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's own peak lr (train.muon_lr)
            self.optimizer.step()
        self._publish()
        if self.loss_scale is not None:
            self._good_steps += 1
            if self._good_steps % _GROWTH_INTERVAL == 0:
                self.loss_scale *= 2
        return StepStats(grad_norm=norm, skipped=False, loss_scale=scale_used)

    def skip(self, norm: float, overflow: bool) -> StepStats:
        """Leave the weights and Adam's moments as they are; with fp16, a gradient `overflow` (a non-finite
        norm) halves the loss scale, as dynamic loss scaling does."""
        scale_used = self.loss_scale
        if overflow and self.loss_scale is not None:
            self.loss_scale = max(self.loss_scale / 2, _MIN_LOSS_SCALE)
            self._good_steps = 0
        return StepStats(grad_norm=norm, skipped=True, loss_scale=scale_used)

    @property
    def loss_scale_at_minimum(self) -> bool:
        """fp16 only: the loss scale cannot be halved any further, so an overflow is no longer its fault."""
        return self.loss_scale is not None and self.loss_scale <= _MIN_LOSS_SCALE

    def step(self, lr: float) -> StepStats:
        """prepare, then apply, or skip when the norm is not finite (every rank of the norm's group sees the
        same all-reduced norm, so they all skip; the trainer also agrees with the other replicas)."""
        norm = self.prepare()
        if not math.isfinite(norm):
            return self.skip(norm, overflow=True)
        return self.apply(lr, norm)

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer's own state (AdamW's moments; this rank's shards)."""
        total = 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.ndim:
                        local = v.to_local() if hasattr(v, "to_local") else v
                        total += local.numel() * local.element_size()
        return total

    def scalar_state(self) -> dict[str, Any]:
        """The state a checkpoint keeps besides the per-parameter tensors: the fp16 loss scale and, for an
        optimizer that counts Adam's steps per param group rather than per parameter (Apex's FusedAdam
        keeps ``group["step"]``; torch's AdamW a ``step`` tensor beside each parameter's moments), that
        count, without which bias correction would restart on resume. Every group steps together."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return {
            "loss_scale": self.loss_scale,
            "good_steps": self._good_steps,
            "group_step": groups[0].get("step") if groups else None,
        }

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this optimizer's state is sharded by."""
        return self.job.parallel.zero_stage

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its shards when sharded) and the scalar state; it loads back on the
        same layout only (llmtrain.checkpoint reshards between layouts)."""
        return {
            **self.scalar_state(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "zero_stage": self.zero_stage,
            "dp": self.topo.dp,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by state_dict on the same layout."""
        if state["zero_stage"] != self.zero_stage or state["dp"] != self.topo.dp:
            raise ValueError(
                f"optimizer state was saved with zero_stage={state['zero_stage']} dp={state['dp']} but "
                f"this run has zero_stage={self.zero_stage} dp={self.topo.dp}; "
                "load it through a checkpoint (llmtrain.checkpoint), which reshards"
            )
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_scalar_state(state)

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore what scalar_state returned (a checkpoint without an entry keeps the current value)."""
        self.loss_scale = state.get("loss_scale", self.loss_scale)
        self._good_steps = state.get("good_steps", 0)
        step = state.get("group_step")
        if step is not None and self.optimizer is not None:
            for group in self.optimizer.param_groups:
                # A tensor count (a capturable optimizer's) is advanced in place: one per group.
                group["step"] = step.clone() if torch.is_tensor(step) else step


class ModelOptimizer(LossScaledOptimizer):
    """AdamW over this rank's share of the flat buffers; see the module docstring. ``make_optimizer``
    builds the update rule over the param groups of fp32 master pieces instead (tests use plain SGD)."""

    def __init__(
        self, model: nn.Module, topo: Topology, job: JobConfig, make_optimizer: MakeOptimizer | None = None
    ) -> None:
        super().__init__(topo, job)
        buffers: GradBuffers | None = getattr(model, "grad_buffers", None)
        if buffers is None:
            apply_dp(model, topo, **dp_options(job))
            buffers = model.grad_buffers
        self.model = model
        self.buffers = buffers
        pieces = buffers.local_ranges()
        total = sum(end - start for _, start, end in pieces)
        # The fp32 master copy of the owned pieces: the parameters themselves in fp32.
        if buffers.dtype == torch.float32:
            self.master_flat = None
            source = buffers.param_buffer
        else:
            self.master_flat = torch.empty(total, dtype=torch.float32, device=buffers.param_buffer.device)
            source = buffers.fp32_init
        self.masters: list[torch.Tensor] = []
        self.param_views: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        counted: list[bool] = []
        decay: list[bool] = []
        pos = 0
        # Under expert parallelism the experts' gradients differ across EP ranks, so the norm is summed over
        # the world; with replicated (zero_stage 0) gradients each piece then counts on the first replica of
        # its reduction group only. ZeRO-1 shards already partition every group.
        first_replica_only = topo.ep > 1 and buffers.zero_stage == 0
        for p, start, end in pieces:
            if self.master_flat is None:
                master = source[start:end]
            else:
                master = self.master_flat[pos : pos + end - start]
                master.copy_(source[start:end])
            pos += end - start
            master.grad = buffers.grad_buffer[start:end]
            self.masters.append(master)
            self.param_views.append(buffers.param_buffer[start:end])
            self.grads.append(master.grad)
            # A copy another rank also holds (TP-replicated norm weight, replicated kv head, tied
            # embedding on another stage) adds nothing to the global norm.
            replica = buffers.bucket_of[p].reduce.index
            counted.append(not getattr(p, "duplicate", False) and not (first_replica_only and replica))
            decay.append(not no_weight_decay(buffers.names[p], p))
        buffers.fp32_init = None
        # zero_stage 0: every DP replica holds the same full gradient, so the norm is summed over the
        # model-parallel ranks only (none at all for pure DP); zero_stage 1: over everyone's shards.
        if (buffers.zero_stage == 1 and buffers.dense.size > 1) or topo.ep > 1:
            self._norm_group, self._norm_ranks = None, topo.world_size
        else:
            self._norm_group, self._norm_ranks = topo.mp_group, topo.tp * topo.pp
        self._counted = [g for g, c in zip(self.grads, counted, strict=True) if c]
        self._tp_reduced = [
            p
            for p in buffers.params
            if getattr(p, "sequence_parallel", False) or getattr(p, "kv_replicas", 1) > 1
        ]
        matrices = flat_matrices(buffers, self.masters, topo) if job.train.optimizer == "muon" else []
        muon = {id(m.key) for m in matrices if m.key is not None}
        rest = [(m, d) for m, d in zip(self.masters, decay, strict=True) if id(m) not in muon]
        wd = job.train.weight_decay
        groups = [
            {"params": [m for m, d in rest if d], "weight_decay": wd},
            {"params": [m for m, d in rest if not d], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        device = buffers.param_buffer.device
        self.optimizer = self._build(groups, make_optimizer, device) if groups else None
        if matrices:
            self.optimizer = MuonAdamW(self.optimizer, matrices, job, *stage_group(topo), device)

    def zero_grad(self) -> None:
        """Zero the fp32 gradient buffer (the trainer calls it before the first micro-batch of a step)."""
        self.buffers.zero_grad()

    def _grads(self) -> list[torch.Tensor]:
        return self.grads

    def _counted_grads(self) -> list[torch.Tensor]:
        return self._counted

    def _finish_reduction(self) -> None:
        self.buffers.finish()
        # Buckets whose parameters the forward never touched may still be gathering into the buffer.
        self.buffers.wait_params()
        reduce_tp_grads(self._tp_reduced, self.topo)

    def _publish(self) -> None:
        if self.master_flat is not None and self.masters:
            torch._foreach_copy_(self.param_views, self.masters)
        if self.buffers.zero_stage == 1:
            self.buffers.all_gather_params()

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 master copy (if separate) plus AdamW states."""
        total = self.master_flat.numel() * 4 if self.master_flat is not None else 0
        return total + super().state_bytes()

    @property
    def zero_stage(self) -> int:
        return self.buffers.zero_stage

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its shard under zero_stage 1), with the fp32 master copy."""
        return {
            **super().state_dict(),
            "master": self.master_flat.clone() if self.master_flat is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by state_dict on the same layout, fp32 master copy included."""
        super().load_state_dict(state)
        if self.master_flat is not None:
            self.master_flat.copy_(state["master"])
