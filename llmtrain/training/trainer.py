"""The optimisation loop: batches in, optimizer steps, evaluation, checkpoints and metrics out."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llmtrain.config import JobConfig, to_dict
from llmtrain.errors import UserError
from llmtrain.training.interrupt import StopRequest, exit_code
from llmtrain.training.lr_schedule import learning_rate
from llmtrain.training.metrics import format_duration
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
    """What one launch of a run did."""

    steps: int
    """The step the run is at when this launch ends."""
    total_steps: int
    steps_run: int
    """Optimizer steps this launch ran (0 when there was nothing to do)."""
    final_loss: float | None
    """Mean training loss over the last logging interval (rank 0); None when no finite loss was seen."""
    final_eval_loss: float | None
    elapsed_s: float
    skipped_steps: int
    output_dir: str
    stopped_by: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped training before train.steps."""
    checkpoint: str | None = None
    """The last checkpoint this launch saved."""
    nothing_to_do: str | None = None
    """Why this launch ran no step (the run was already at train.steps)."""

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal that stopped the run (130 for SIGINT, 143 for SIGTERM)."""
        return exit_code(self.stopped_by) if self.stopped_by else 0

    def summary(self) -> str:
        """The launch's last line on the console; it never shows a loss for steps it did not run."""
        if self.nothing_to_do is not None:
            return self.nothing_to_do
        took = f"{self.elapsed_s:.1f}s" if self.elapsed_s < 60 else format_duration(self.elapsed_s)
        figures = f"{self.steps_run} steps in {took}"
        if self.final_loss is not None:
            figures += f", loss {self.final_loss:.4f}"
        if self.final_eval_loss is not None:
            figures += f", eval loss {self.final_eval_loss:.4f}"
        if self.skipped_steps:
            figures += f", {self.skipped_steps} skipped"
        if self.stopped_by:
            return (
                f"stopped by {signal.Signals(self.stopped_by).name} at step {self.steps}/{self.total_steps} "
                f"({figures}); checkpoint {self.checkpoint}; rerun the same command to resume at step "
                f"{self.steps + 1}"
            )
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        return f"done: step {self.steps}/{self.total_steps} ({figures}); output in {self.output_dir}{saved}"


class TrainingDiverged(UserError, RuntimeError):
    """Too many consecutive steps had a non-finite loss."""

    exit_code = 3


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
        self.stop = StopRequest(announce=topo.rank == 0)
        self.stop_signal = 0  # agreed by all ranks at the last step boundary
        self.save_clock_due = False  # rank 0's clock said checkpoint.interval_minutes passed (agreed)
        self._last_save_time = time.monotonic()
        self.last_checkpoint: str | None = None

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        """Average a loss over the data-parallel replicas (each saw a different slice of the batch)."""
        group = self.topo.dp_group
        if group is not None and self.topo.dp > 1:
            value = value.to(self.topo.device, copy=True)  # NCCL reduces only device tensors
            with self.topo.watchdog.waiting("dp", "all_reduce", "loss"), self.timer.section("dp_comm"):
                dist.all_reduce(value, group=group)
            value /= self.topo.dp
        return float(value)

    def _agree(self, flags: list[float]) -> list[float]:
        """Each flag's maximum over all ranks, so every rank takes the same branch.

        The step's one world-wide collective: it carries the non-finite-loss check, the stop signal and
        rank 0's checkpoint clock together, so agreeing on them costs no extra collective.
        """
        if not dist.is_initialized():
            return flags
        tensor = torch.tensor(flags, dtype=torch.float32, device=self.topo.device)
        with self.topo.watchdog.waiting("world", "all_reduce", "non-finite loss / stop / checkpoint check"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _clock_says_save(self) -> bool:
        """On rank 0 only: checkpoint.interval_minutes of wall-clock time passed since the last save."""
        minutes = self.job.checkpoint.interval_minutes
        return self.topo.rank == 0 and minutes > 0 and time.monotonic() - self._last_save_time >= 60 * minutes

    def restore(self, path: str | Path | None) -> None:
        """Load the checkpoint this launch starts from (None: start at step 0)."""
        if path is None:
            return
        extra = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = int(extra["step"])
        self.consumed_samples = int(extra["consumed_samples"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "config": to_dict(self.job),
        }

    def _saved(self, path: Path, seconds: float) -> None:
        where = " (written in the background)" if self.job.checkpoint.async_save else ""
        self.metrics.note(f"checkpoint saved: {path} in {seconds:.1f}s{where}")

    def save(self) -> None:
        """Checkpoint the current step (returns while an async save is still writing)."""
        self.checkpointer.save(
            self.step, self.model, self.optimizer, self._checkpoint_extra(), on_saved=self._saved
        )
        self.last_checkpoint = str(self.checkpointer.root / f"step_{self.step}")
        self._last_save_time = time.monotonic()

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
        not_finite, stop_signal, clock = self._agree(
            [float(not math.isfinite(loss)), float(self.stop.signum), float(self._clock_says_save())]
        )
        self.stop_signal, self.save_clock_due = int(stop_signal), bool(clock)
        grad_norm, loss_scale = float("nan"), None
        if not_finite:
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
        """Train from the current step until train.steps, evaluating and checkpointing on schedule.

        A SIGINT or SIGTERM ends training after the step it arrived in, with a checkpoint of that step.
        """
        train = self.job.train
        first_step = self.step
        start = time.perf_counter()
        self._last_save_time = time.monotonic()
        batches = self.data.train_batches(self.consumed_samples)
        profiler = ProfilerWindow(self.job.logging.profile_steps, self.job.output_dir, self.topo.rank)
        eval_loss = None
        try:
            with self.stop:
                while self.step < train.steps:
                    with profiler.step(self.step + 1):
                        values = self._train_step(batches)
                    stopping = self.stop_signal != 0
                    last = self.step == train.steps
                    self.metrics.log_step(self.step, values, last=stopping)
                    eval_due = train.eval_interval and (self.step % train.eval_interval == 0 or last)
                    # Evaluation is skipped when stopping: preemption leaves seconds for the checkpoint.
                    if eval_due and not stopping:
                        eval_loss = self.evaluate()
                        self.metrics.log_eval(self.step, eval_loss)
                    if stopping or self.save_clock_due or self.checkpointer.is_due(self.step, final=last):
                        self.save()
                    if stopping:
                        break
                self.checkpointer.wait()  # an async save is complete before the launch reports its end
        finally:
            profiler.close()
        return TrainResult(
            steps=self.step,
            total_steps=train.steps,
            steps_run=self.step - first_step,
            final_loss=self.metrics.last_loss_avg,
            final_eval_loss=eval_loss,
            elapsed_s=time.perf_counter() - start,
            skipped_steps=self.skipped_steps,
            output_dir=self.job.output_dir,
            stopped_by=self.stop_signal if self.stop_signal and self.step < train.steps else None,
            checkpoint=self.last_checkpoint,
        )
