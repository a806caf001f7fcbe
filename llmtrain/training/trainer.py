"""The optimisation loop: batches in, optimizer steps, evaluation, checkpoints and metrics out."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llmtrain.config import JobConfig, to_dict
from llmtrain.training.lr_schedule import learning_rate
from llmtrain.training.profiling import ProfilerWindow, StepTimer


class StepRunner(Protocol):
    """Runs the forward and backward passes of one global batch slice on this rank."""

    def train_step(self, batch: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        """Accumulate gradients over the micro-batches of `batch`; return the mean loss (a 0-d tensor)."""

    def eval_step(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean loss of `batch` without gradients."""


class LocalStepRunner:
    """Gradient accumulation over micro-batches for a model that lives whole on this pipeline rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        micro_batch_size: int,
        grad_sync: Any,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.grad_sync = grad_sync
        self.device = torch.device(device)

    def train_step(self, batch: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        self.model.train()
        micro_batches = batch.to(self.device).split(self.micro_batch_size)
        total = torch.zeros((), dtype=torch.float32)
        for index, micro in enumerate(micro_batches):
            # Data-parallel gradient reduction only runs with the last micro-batch's backward.
            with self.grad_sync(self.model, enabled=index == len(micro_batches) - 1):
                with timer.section("forward"):
                    loss = self.model(micro[:, :-1], labels=micro[:, 1:])
                with timer.section("backward"):
                    self.optimizer.backward(loss / len(micro_batches))
            total += loss.detach().float().cpu()
        return total / len(micro_batches)

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        losses = [
            self.model(m[:, :-1], labels=m[:, 1:]).float().cpu()
            for m in batch.to(self.device).split(self.micro_batch_size)
        ]
        return torch.stack(losses).mean()


@dataclass
class TrainResult:
    """What a finished run reports."""

    steps: int
    final_loss: float
    final_eval_loss: float | None
    elapsed_s: float
    skipped_steps: int


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss."""


class Trainer:
    """Drives a run; every collaborator is built outside and passed in."""

    def __init__(
        self,
        job: JobConfig,
        topo: Any,
        runner: StepRunner,
        optimizer: Any,
        data: Any,
        metrics: Any,
        checkpointer: Any,
        model: torch.nn.Module,
        tokens_per_sample: int,
    ) -> None:
        self.job = job
        self.topo = topo
        self.runner = runner
        self.optimizer = optimizer
        self.data = data
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.model = model
        self.tokens_per_sample = tokens_per_sample
        self.timer = StepTimer(job.logging.time_breakdown)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.bad_steps_in_a_row = 0

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        """Average a loss over the data-parallel replicas (each saw a different slice of the batch)."""
        group = self.topo.dp_group
        if group is not None and self.topo.dp > 1:
            value = value.to(self.topo.device, copy=True)  # NCCL reduces only device tensors
            with self.topo.watchdog.waiting("dp", "all_reduce", "loss"), self.timer.section("dp_comm"):
                dist.all_reduce(value, group=group)
            value /= self.topo.dp
        return float(value)

    def _any_rank(self, flag: bool) -> bool:
        """True when `flag` is true on any rank, so every rank takes the same branch."""
        if not dist.is_initialized():
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.topo.device)
        with self.topo.watchdog.waiting("world", "all_reduce", "non-finite loss check"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def restore(self) -> None:
        """Resume from the latest checkpoint (or checkpoint.load) when there is one."""
        path = self.checkpointer.resume_path()
        if path is None:
            return
        extra = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = int(extra["step"])
        self.consumed_samples = int(extra["consumed_samples"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.metrics.note(f"resumed from {path} at step {self.step}")

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "config": to_dict(self.job),
        }

    def evaluate(self) -> float:
        losses = [
            self.runner.eval_step(batch) for batch in self.data.eval_batches(self.job.train.eval_batches)
        ]
        return self._mean_over_dp(torch.stack(losses).mean())

    def _train_step(self, batches: Iterator[torch.Tensor]) -> dict[str, Any]:
        """One optimizer step (or a skipped one after a non-finite loss); returns what gets logged."""
        train = self.job.train
        start = time.perf_counter()
        batch = next(batches)
        data_time = time.perf_counter() - start
        lr = learning_rate(train, self.step)
        loss = self._mean_over_dp(self.runner.train_step(batch, self.timer))
        grad_norm, loss_scale = float("nan"), None
        if self._any_rank(not math.isfinite(loss)):
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            self.bad_steps_in_a_row += 1
            if self.bad_steps_in_a_row >= train.max_bad_steps:
                raise TrainingDiverged(
                    f"loss was not finite for {self.bad_steps_in_a_row} steps in a row (up to step "
                    f"{self.step + 1}); stopping. Lower train.lr or raise train.max_bad_steps; the last "
                    "good checkpoint is kept."
                )
        else:
            with self.timer.section("optimizer"):
                stats = self.optimizer.step(lr)
                self.optimizer.zero_grad()
            grad_norm, loss_scale = stats.grad_norm, stats.loss_scale
            self.skipped_steps += int(stats.skipped)
            self.bad_steps_in_a_row = 0
        self.step += 1
        self.consumed_samples += train.global_batch_size
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_scale": loss_scale,
            "skipped_steps": self.skipped_steps,
            "samples": train.global_batch_size,
            "tokens": train.global_batch_size * self.tokens_per_sample,
            "step_time": time.perf_counter() - start,
            "data_time": data_time,
            "breakdown": self.timer.pop(),
        }

    def fit(self) -> TrainResult:
        """Train until train.steps, evaluating and checkpointing on schedule."""
        train = self.job.train
        self.restore()
        start = time.perf_counter()
        batches = self.data.train_batches(self.consumed_samples)
        profiler = ProfilerWindow(self.job.logging.profile_steps, self.job.output_dir, self.topo.rank)
        last_loss = float("nan")
        eval_loss = None
        try:
            while self.step < train.steps:
                with profiler.step(self.step + 1):
                    values = self._train_step(batches)
                if math.isfinite(values["loss"]):
                    last_loss = values["loss"]
                self.metrics.log_step(self.step, values)
                last = self.step == train.steps
                if train.eval_interval and (self.step % train.eval_interval == 0 or last):
                    eval_loss = self.evaluate()
                    self.metrics.log_eval(self.step, eval_loss)
                if self.checkpointer.is_due(self.step, final=last):
                    self.checkpointer.save(self.step, self.model, self.optimizer, self._checkpoint_extra())
            self.checkpointer.wait()
        finally:
            profiler.close()
        return TrainResult(
            steps=self.step,
            final_loss=last_loss,
            final_eval_loss=eval_loss,
            elapsed_s=time.perf_counter() - start,
            skipped_steps=self.skipped_steps,
        )
