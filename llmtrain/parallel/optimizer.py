"""The model's optimizer: fp32 master weights, AdamW, loss scaling, global-norm clipping, optional ZeRO-1.

It works on the flat buffers of `data_parallel.GradBuffers`: each rank updates the pieces of the buffer it
owns (everything for zero_stage 0, its 1/dp shard of every bucket for zero_stage 1). The master weights are
the parameters themselves in fp32 (no copy), an fp32 copy of the owned pieces in bf16/fp16.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.parallel import comm
from llmtrain.parallel.data_parallel import GradBuffers, apply_dp
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


def dp_options(job: JobConfig) -> dict[str, Any]:
    """apply_dp's keyword arguments for this job."""
    p = job.parallel
    return {
        "precision": job.train.precision,
        "zero_stage": p.zero_stage,
        "bucket_mb": p.dp_bucket_mb,
        "overlap_param_gather": p.overlap_param_gather,
    }


class ModelOptimizer:
    """AdamW over this rank's share of the flat buffers; see the module docstring. ``make_optimizer``
    builds the update rule over the param groups of fp32 master pieces instead (tests use plain SGD)."""

    def __init__(
        self, model: nn.Module, topo: Topology, job: JobConfig, make_optimizer: MakeOptimizer | None = None
    ) -> None:
        buffers: GradBuffers | None = getattr(model, "grad_buffers", None)
        if buffers is None:
            apply_dp(model, topo, **dp_options(job))
            buffers = model.grad_buffers
        self.model = model
        self.buffers = buffers
        self.topo = topo
        self.job = job
        self.precision = job.train.precision
        self.grad_clip = job.train.grad_clip
        self.loss_scale: float | None = job.train.initial_loss_scale if self.precision == "fp16" else None
        self._good_steps = 0
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
            counted.append(not getattr(p, "duplicate", False))
            decay.append(not no_weight_decay(buffers.names[p], p))
        buffers.fp32_init = None
        # zero_stage 0: every DP replica holds the same full gradient, so the norm is summed over the
        # model-parallel ranks only (none at all for pure DP); zero_stage 1: over everyone's shards.
        if buffers.zero_stage == 1 and topo.dp > 1:
            self._norm_group, self._norm_ranks = None, topo.world_size
        else:
            self._norm_group, self._norm_ranks = topo.mp_group, topo.tp * topo.pp
        self._counted = [g for g, c in zip(self.grads, counted, strict=True) if c]
        self._tp_reduced = [
            p
            for p in buffers.params
            if getattr(p, "sequence_parallel", False) or getattr(p, "kv_replicas", 1) > 1
        ]
        wd = job.train.weight_decay
        groups = [
            {"params": [m for m, d in zip(self.masters, decay, strict=True) if d], "weight_decay": wd},
            {"params": [m for m, d in zip(self.masters, decay, strict=True) if not d], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        device = buffers.param_buffer.device
        make = make_optimizer or (lambda g: _make_adamw(g, job, device))
        self.optimizer = make(groups) if groups else None

    def zero_grad(self) -> None:
        """Zero the fp32 gradient buffer (the trainer calls it before the first micro-batch of a step)."""
        self.buffers.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the loss scale in fp16."""
        if self.loss_scale is not None:
            loss = loss * self.loss_scale
        loss.backward()

    def global_grad_norm(self) -> float:
        """L2 norm of the full gradient over every TP/PP/DP shard, each element counted once."""
        if self._counted:
            sumsq = torch.stack(torch._foreach_norm(self._counted, 2.0)).double().pow(2).sum()
        else:
            sumsq = torch.zeros((), dtype=torch.float64, device=self.buffers.grad_buffer.device)
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
        self.buffers.finish()
        # Buckets whose parameters the forward never touched may still be gathering into the buffer.
        self.buffers.wait_params()
        reduce_tp_grads(self._tp_reduced, self.topo)
        if self.loss_scale is not None and self.grads:
            torch._foreach_mul_(self.grads, 1.0 / self.loss_scale)
        if inject_inf and self._counted:
            self._counted[0].view(-1)[0] = math.inf
        return self.global_grad_norm()

    def apply(self, lr: float, norm: float) -> StepStats:
        """Clip to train.grad_clip by `norm` (prepare's), update, and publish the new parameters."""
        scale_used = self.loss_scale
        if self.grad_clip > 0 and self.grads:
            # Same coefficient as torch.nn.utils.clip_grad_norm_.
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_(self.grads, coef)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if self.master_flat is not None and self.masters:
            torch._foreach_copy_(self.param_views, self.masters)
        if self.buffers.zero_stage == 1:
            self.buffers.all_gather_params()
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
        """Bytes this rank holds for the optimizer: fp32 master copy (if separate) plus AdamW states."""
        total = self.master_flat.numel() * 4 if self.master_flat is not None else 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                total += sum(
                    v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.ndim
                )
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

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore what scalar_state returned (a checkpoint without an entry keeps the current value)."""
        self.loss_scale = state.get("loss_scale", self.loss_scale)
        self._good_steps = state.get("good_steps", 0)
        step = state.get("group_step")
        if step is not None and self.optimizer is not None:
            for group in self.optimizer.param_groups:
                # A tensor count (a capturable optimizer's) is advanced in place: one per group.
                group["step"] = step.clone() if torch.is_tensor(step) else step

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its shard under zero_stage 1)."""
        return {
            **self.scalar_state(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "master": self.master_flat.clone() if self.master_flat is not None else None,
            "zero_stage": self.buffers.zero_stage,
            "dp": self.topo.dp,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by state_dict on the same layout."""
        if state["zero_stage"] != self.buffers.zero_stage or state["dp"] != self.topo.dp:
            raise ValueError(
                f"optimizer state was saved with zero_stage={state['zero_stage']} dp={state['dp']} but "
                f"this run has zero_stage={self.buffers.zero_stage} dp={self.topo.dp}; "
                "reshard it with the checkpoint converter"
            )
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.master_flat is not None:
            self.master_flat.copy_(state["master"])
        self.load_scalar_state(state)


def build_optimizer(
    model: nn.Module, topo: Topology, job: JobConfig, make_optimizer: MakeOptimizer | None = None
) -> ModelOptimizer:
    """The ModelOptimizer of a (parallelized) model; installs the flat buffers if parallelize did not."""
    return ModelOptimizer(model, topo, job, make_optimizer)
