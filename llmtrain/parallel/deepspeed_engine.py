"""DeepSpeed's ZeRO engine (stages 1-3, optimizer and parameter offload to CPU or NVMe) behind the optimizer
interface the trainer drives (prepare / apply / skip / zero_grad / backward), selected by
``parallel.engine=deepspeed``; it saves and resumes llmtrain's layout-free checkpoints (checkpoint_view,
restore).

The model is wrapped whole by ``deepspeed.initialize`` with a config built from the JobConfig: the zero
stage, offload (DeepSpeedCPUAdam, which ZeRO-Offload requires; torch's AdamW otherwise), bf16,
gradient clipping at train.grad_clip and accumulation over global / (micro * dp) micro-batches, the same
AdamW hyper-parameters and weight-decay groups as llmtrain's own engine; the trainer sets the lr per step.

The trainer decides to apply or skip a step only after every rank has reported its gradient norm, while
DeepSpeed decides inside ``engine.step()``. So ``prepare`` reads DeepSpeed's own norm of the reduced
gradients (the one its step clips by) without stepping, ``apply`` steps, and ``skip`` steps through
DeepSpeed's own discard path, the one it takes for a non-finite gradient norm (gradients and offload
buffers cleared, Adam's moments and the weights untouched, ``engine.skipped_steps`` counted), by
reporting an infinite norm for that one step.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.errors import CheckpointError
from llmtrain.parallel.optimizer import StepStats, _make_adamw, no_weight_decay
from llmtrain.parallel.topology import Topology


def deepspeed_config(job: JobConfig, dp: int) -> dict[str, Any]:
    """The DeepSpeed config dict of `job` on `dp` data-parallel ranks (the optimizer is passed apart)."""
    t, p = job.train, job.parallel
    # dp_bucket_mb counts fp32 bytes; DeepSpeed's bucket sizes count elements.
    bucket = int(p.dp_bucket_mb * 2**20 / 4)
    pin = torch.cuda.is_available()  # pinned host memory needs CUDA
    zero: dict[str, Any] = {
        "stage": p.zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "contiguous_gradients": True,
    }
    # offload_device=nvme: the offloaded tensors live in swap files under nvme_path (ZeRO-Infinity).
    where: dict[str, Any] = {"device": p.offload_device, "pin_memory": pin}
    if p.offload_device == "nvme":
        where["nvme_path"] = p.nvme_path
    if p.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = dict(where)
    if p.offload == "optimizer+params":
        zero["offload_param"] = dict(where)
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        # A non-finite gradient norm discards the step in bf16 too (skip() relies on it).
        "bf16": {"enabled": t.precision == "bf16", "check_grad_overflow": True},
        # torch's AdamW (without offload) is not one of DeepSpeed's own optimizers.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """llmtrain's weight-decay groups (see optimizer.no_weight_decay) over the model's parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not no_weight_decay(n, p)]
    rest = [p for n, p in named if no_weight_decay(n, p)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _make_optimizer(groups: list[dict[str, Any]], job: JobConfig, device: torch.device) -> Any:
    """DeepSpeedCPUAdam in AdamW mode when the optimizer lives on the CPU (ZeRO-Offload needs it),
    llmtrain's own AdamW choice otherwise."""
    if job.parallel.offload == "none":
        return _make_adamw(groups, job, device)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    t = job.train
    return DeepSpeedCPUAdam(
        groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, adamw_mode=True
    )


class DeepSpeedOptimizer:
    """The trainer's optimizer interface over a DeepSpeed engine; see the module docstring."""

    loss_scale: float | None = None  # fp16 is rejected with this engine (config validation)
    loss_scale_at_minimum = False

    def __init__(self, engine: Any, job: JobConfig) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.job = job

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed clears its gradients inside step(), applied or discarded."""

    def backward(self, loss: torch.Tensor) -> None:
        """The engine's backward; the runner has already divided the loss by the micro-batch count."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def _global_norm(self) -> float:
        """DeepSpeed's L2 norm of the reduced gradients over every rank (a collective), unscaled."""
        if hasattr(self.zero, "scaled_global_norm"):  # stages 1 and 2
            groups = [self.zero.scaled_global_norm()]
        else:  # stage 3: one norm per parameter group
            groups = self.zero._get_norm_groups()
        norms = [float(n) for n in groups]
        # DeepSpeed's norm helpers report a non-finite norm as -1.
        if any(n < 0 or not math.isfinite(n) for n in norms):
            return math.inf
        return math.sqrt(sum(n * n for n in norms)) / self.zero.loss_scale

    def prepare(self, inject_inf: bool = False) -> float:
        """The global gradient norm after the last micro-batch's backward (inf when a gradient is
        not finite); then exactly one of apply or skip ends the step. `inject_inf` (the `inf_grad` fault)
        reports inf on this rank only."""
        norm = self._global_norm()
        return math.inf if inject_inf else norm

    def _set_lr(self, lr: float) -> None:
        for group in self.zero.param_groups:
            group["lr"] = lr

    def apply(self, lr: float, norm: float) -> StepStats:
        """Clip (DeepSpeed, at train.grad_clip by the same norm) and update at `lr`."""
        self._set_lr(lr)
        self.engine.step()
        if not self.engine.was_step_applied():
            raise RuntimeError(
                f"DeepSpeed discarded a step whose gradient norm {norm} all ranks found finite"
            )
        return StepStats(grad_norm=norm, skipped=False, loss_scale=None)

    def skip(self, norm: float, overflow: bool) -> StepStats:
        """Discard the step through DeepSpeed's own path for a non-finite norm (see the module docstring)."""
        with _norm_reported_infinite(self.zero):
            self.engine.step()
        if self.engine.was_step_applied():
            raise RuntimeError("DeepSpeed applied a step llmtrain decided to skip")
        return StepStats(grad_norm=norm, skipped=True, loss_scale=None)

    def checkpoint_view(self, loading: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The engine's state as llmtrain's layout-free checkpoints hold it (llmtrain.checkpoint asks for
        it): a model of full fp32 weights (DeepSpeed's fp32 masters) and a torch AdamW over it holding the
        full exp_avg, exp_avg_sq and step, so a run on either engine resumes from the checkpoint. Every
        rank gathers full copies (collectives; transient memory of the model plus its Adam states).

        `loading`: an empty view for a checkpoint to be read into, which `restore` then installs (refused
        with NVMe offload: the Adam states live in DeepSpeed's swap files, which `restore` does not write)."""
        if loading and self.job.parallel.offload_device == "nvme":
            raise CheckpointError(
                "parallel.offload_device=nvme cannot resume from a checkpoint yet; resume with "
                "parallel.offload_device=cpu (checkpoints are layout-free)"
            )
        from llmtrain import models

        # Built on the CPU (not meta + to_empty, which would untie tied embeddings); overwritten below.
        full = models.build(self.job.model)
        t = self.job.train
        # The checkpoint keeps its param groups' hyper-parameters, which a resume installs: the job's.
        adamw = torch.optim.AdamW(
            _param_groups(full, t.weight_decay),
            lr=self.zero.param_groups[0]["lr"],
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
        )
        if loading:
            return full, adamw
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._link_adam_states()
        targets = dict(full.named_parameters())
        steps = [s["step"] for s in self.zero.optimizer.state.values() if "step" in s]
        step = torch.tensor(float(steps[0]) if steps else 0.0)
        for name, param in self.engine.module.named_parameters():
            target = targets[name]
            with torch.no_grad():
                target.copy_(safe_get_full_fp32_param(param))
            moments = {key: safe_get_full_optimizer_state(param, key) for key in ADAM_MOMENTS}
            if all(m is not None for m in moments.values()):
                adamw.state[target] = {"step": step.clone(), **{k: m.cpu() for k, m in moments.items()}}
        return full, adamw

    def restore(self, full: nn.Module, adamw: torch.optim.Optimizer) -> None:
        """Install a loaded view (see `checkpoint_view(loading=True)`) into the engine: the fp32 masters,
        the model's own (bf16 or fp32, partitioned at ZeRO-3) weights cast from them, Adam's moments and
        step, and the param groups' Adam hyper-parameters. Collective at ZeRO-3 (gathers each weight)."""
        import deepspeed

        sources = dict(full.named_parameters())
        states = [adamw.state.get(p, {}) for p in full.parameters()]
        steps = [float(s["step"]) for s in states if "step" in s]
        if steps:
            self._create_adam_states(int(steps[0]))
        stage3 = self.job.parallel.zero_stage == 3
        with torch.no_grad():
            for name, param in self.engine.module.named_parameters():
                source = sources[name].detach()
                state = adamw.state.get(sources[name], {})
                self._set_full(param, source, None)
                for key in ADAM_MOMENTS if steps and state else ():
                    self._set_full(param, state[key], key)
            params = list(self.engine.module.parameters())
            # The model's own copy (full on every rank at stages 1/2, gathered at stage 3, where every rank
            # writes the same values and rank 0's are kept).
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=stage3):
                for name, param in self.engine.module.named_parameters():
                    param.data.copy_(sources[name].detach().to(param.dtype))
        for group, saved in zip(self.zero.param_groups, adamw.param_groups, strict=True):
            group.update({k: saved[k] for k in ("betas", "eps", "weight_decay")})

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The flat fp32 partitions this rank's Adam updates (DeepSpeed keys its Adam states by them)."""
        if self.job.parallel.zero_stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def _create_adam_states(self, step: int) -> None:
        """Adam states at `step` (zero moments) for every flat partition that has none yet: torch's AdamW
        and DeepSpeedCPUAdam create them at their first update, and a resume loads into them before it."""
        optimizer = self.zero.optimizer
        if type(optimizer).__name__ == "FusedAdam":  # apex counts steps per param group
            for group in optimizer.param_groups:
                group["step"] = step
        for flat in self._flat_partitions():
            if optimizer.state.get(flat):
                optimizer.state[flat]["step"] = _adam_step(optimizer, flat, step)
                continue
            optimizer.state[flat] = {
                "step": _adam_step(optimizer, flat, step),
                **{key: torch.zeros_like(flat) for key in ADAM_MOMENTS},
            }
        self._link_adam_states()

    def _link_adam_states(self) -> None:
        """Point stages 1/2's per-parameter views at the Adam states (DeepSpeed 0.19.8 links them after the
        first group's first update, when the other groups' states do not exist yet: linked again here)."""
        if hasattr(self.zero, "_hp_optimizer_states_linked"):
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()

    def _set_full(self, param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
        """Write this rank's share of the full tensor `value` into the fp32 master of `param` (key None)
        or into its Adam state `key`."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if not hasattr(param, "ds_id"):  # stages 1/2: DeepSpeed's own setters
            if key is None:
                safe_set_full_fp32_param(param, value)
            else:
                safe_set_full_optimizer_state(param, value, key)
            return
        # Stage 3: DeepSpeed's setter narrows the unpadded tensor at the padded partition's offset, which
        # runs past its end on the last rank of a parameter whose size the ranks do not divide.
        part, _ = self.zero._get_fp32_opt_state_partition(
            param, release_swap_buffers=False, optim_state_key=key
        )
        start = part.numel() * self.zero._get_param_partition_rank(param)
        mine = value.reshape(-1)[start : start + part.numel()]
        part[: mine.numel()].copy_(mine)
        part[mine.numel() :].zero_()


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _adam_step(optimizer: Any, flat: torch.Tensor, step: int) -> Any:
    """Adam's step count as `optimizer` keeps it: an int for DeepSpeedCPUAdam, for torch's AdamW a float32
    tensor, on the parameter's device when fused or capturable, else on the CPU."""
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":
        return step
    group = optimizer.param_groups[0]
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=flat.device if on_device else "cpu")


@contextlib.contextmanager
def _norm_reported_infinite(zero_optimizer: Any) -> Iterator[None]:
    """Make the ZeRO optimizer's next gradient-norm computation return inf (an instance attribute that
    shadows its method for the duration)."""
    inf = torch.tensor(math.inf)
    if hasattr(zero_optimizer, "scaled_global_norm"):
        name, value = "scaled_global_norm", lambda *args, **kwargs: inf
    else:
        name, value = "_get_norm_groups", lambda: [inf]
    setattr(zero_optimizer, name, value)
    try:
        yield
    finally:
        delattr(zero_optimizer, name)


@contextlib.contextmanager
def grad_sync(engine: Any, enabled: bool) -> Iterator[None]:
    """LocalStepRunner's grad_sync for the engine: only the last micro-batch's backward is DeepSpeed's
    gradient-accumulation boundary, where it reduces (and offloads) the gradients."""
    engine.set_gradient_accumulation_boundary(enabled)
    yield


def build_deepspeed(model: nn.Module, topo: Topology, job: JobConfig) -> tuple[Any, DeepSpeedOptimizer]:
    """Wrap the (unsplit, fp32) model in a DeepSpeed engine; return the engine, which runs forward like
    the model, and the optimizer adapter the trainer drives."""
    import deepspeed

    if not dist.is_initialized():
        # DeepSpeed needs a process group even on one process.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # DeepSpeed reads this rank's device from LOCAL_RANK, which torchrun sets and other launchers may not:
    # the device llmtrain already chose (its index on CUDA; the CPU has one).
    os.environ.setdefault("LOCAL_RANK", str(topo.device.index or 0))
    optimizer = _make_optimizer(_param_groups(model, job.train.weight_decay), job, topo.device)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(job, topo.dp), dist_init_required=False
    )
    return engine, DeepSpeedOptimizer(engine, job)
