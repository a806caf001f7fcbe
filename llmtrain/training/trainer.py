"""The optimisation loop: batches in, optimizer steps, evaluation, checkpoints and metrics out."""

from __future__ import annotations

import math
import signal
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llmtrain.config import JobConfig, to_dict
from llmtrain.errors import UserError
from llmtrain.faults import injected
from llmtrain.models.moe import RouterFigures, update_score_bias
from llmtrain.models.mtp import MultiTokenPrediction, mtp_loss_weight, set_mtp_loss_weight
from llmtrain.parallel import comm
from llmtrain.training.interrupt import StopRequest, exit_code
from llmtrain.training.lr_schedule import learning_rate
from llmtrain.training.memory_tracking import PeakMemory
from llmtrain.training.metrics import format_duration
from llmtrain.training.profiling import ProfilerWindow, StepTimer


class StepRunner(Protocol):
    """Runs the forward and backward passes of one global batch slice on this rank."""

    def train_step(self, batch: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        """Accumulate gradients over the micro-batches of `batch`; return the mean loss (a 0-d tensor, on
        the host or still on the device: the trainer reads it once). With uneven shares per replica it is
        the replica's summed loss over the even share's micro-batch count, so the mean over replicas is the
        global batch's mean."""

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
        loss_divisor: float | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.grad_sync = grad_sync
        self.device = torch.device(device)
        self.loss_divisor = loss_divisor
        """With uneven micro-batches per replica (train.dp_micro_batches): the global batch's micro-batches
        / dp, what each micro-batch's loss is divided by, so that the data-parallel reduction's mean over
        replicas of their sums is the mean over the global batch. None: this replica's own count (equal
        shares, where the two agree)."""
        self.router_figures: RouterFigures | None = None
        """The last train_step's RouterFigures; None for a dense model."""
        self.mtp = next((m for m in model.modules() if isinstance(m, MultiTokenPrediction)), None)
        self.mtp_losses: torch.Tensor | None = None
        """The last train_step's multi-token prediction cross-entropy per depth (mean over its
        micro-batches, (D,)); None without model.mtp_layers."""

    def train_step(self, batch: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        self.model.train()
        micro_batches = batch.to(self.device).split(self.micro_batch_size)
        # Summed on the device: one host sync per step (the trainer's), not one per micro-batch. In float64,
        # where a few fp32 losses add exactly: the mean is the same bits however the batch is split.
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        figures: list[RouterFigures] = []
        depths: list[torch.Tensor] = []
        divisor = self.loss_divisor or len(micro_batches)
        for index, micro in enumerate(micro_batches):
            # Data-parallel gradient reduction only runs with the last micro-batch's backward.
            with self.grad_sync(self.model, enabled=index == len(micro_batches) - 1):
                with timer.section("forward"):
                    loss = self.model(micro[:, :-1], labels=micro[:, 1:])
                    figures += self._router_figures()
                    if self.mtp is not None:
                        depths.append(self.mtp.last_losses)
                with timer.section("backward"):
                    self.optimizer.backward(loss / divisor)
            total += loss.detach().double()
        self.router_figures = RouterFigures.combine(figures) if figures else None
        self.mtp_losses = torch.stack(depths).mean(0) if depths else None
        return total / divisor

    def _router_figures(self) -> list[RouterFigures]:
        """The RouterFigures of the forward that just ran, detached; [] for a dense model."""
        stats = self.model.router_stats() if hasattr(self.model, "router_stats") else []
        return [RouterFigures.of(stats, self.model.config)] if stats else []

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        losses = [
            self.model(m[:, :-1], labels=m[:, 1:]).float()
            for m in batch.to(self.device).split(self.micro_batch_size)
        ]
        return torch.stack(losses).sum() / (self.loss_divisor or len(losses))


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
    """The newest complete checkpoint when this launch ends (a save that failed leaves the one before)."""
    nothing_to_do: str | None = None
    """Why this launch ran no step (the run was already at train.steps)."""
    exported_hf: str | None = None
    """The Hugging Face model directory checkpoint.export_hf wrote at the end of training."""

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
            resume = (
                f"checkpoint {self.checkpoint}; rerun the same command to resume from it"
                if self.checkpoint
                else "no checkpoint was saved; a rerun starts over"
            )
            return (
                f"stopped by {signal.Signals(self.stopped_by).name} at step {self.steps}/{self.total_steps} "
                f"({figures}); {resume}"
            )
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        saved += f"; Hugging Face model {self.exported_hf}" if self.exported_hf else ""
        return f"done: step {self.steps}/{self.total_steps} ({figures}); output in {self.output_dir}{saved}"


class TrainingDiverged(UserError, RuntimeError):
    """train.max_bad_steps steps in a row were skipped (non-finite loss or gradient, loss spike)."""

    exit_code = 3


# Each rank's contribution to the step's agreement (Trainer._agree), by position.
_LOSS, _GRAD_NORM, _STOP, _SAVE_CLOCK, _COMPUTE_TIME, _PEAK_MEMORY, _STARTUP_MEMORY = range(7)


def _with_loss_faults(loss: float, step: int, rank: int) -> float:
    """This rank's loss as the `nan_loss` fault (NaN) or the `loss_spike` fault (times its `factor`,
    default 10) makes it; see llmtrain.faults. A fault without `rank=` hits every rank."""
    if injected("nan_loss", step=step, rank=rank) is not None:
        return math.nan
    spike = injected("loss_spike", step=step, rank=rank)
    if spike is not None:
        return loss * float(spike.params.get("factor", "10"))
    return loss


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
        memory: PeakMemory | None = None,
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
        self.memory = memory or PeakMemory(topo.device, track_cpu_tensors=False)
        self.timer = StepTimer(job.logging.time_breakdown)
        self.step = 0
        self.consumed_samples = 0
        self.data_position: dict | None = None
        """The checkpoint's data position (raw sources' streams), given to the data when training starts."""
        self.skipped_steps = 0
        self.bad_steps_in_a_row = 0
        self.good_losses: deque[float] = deque(maxlen=job.train.loss_spike_window)
        """The losses of the last train.loss_spike_window steps whose update was applied."""
        self.stop = StopRequest(announce=topo.rank == 0)
        self.stop_signal = 0  # agreed by all ranks at the last step boundary
        self.save_clock_due = False  # rank 0's clock said checkpoint.interval_minutes passed (agreed)
        self._last_save_time = time.monotonic()
        self.last_skip_reason: str | None = None

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        """Average a loss over the data-parallel replicas (each saw a different slice of the batch)."""
        group = self.topo.dp_group
        if group is not None and self.topo.dp > 1:
            value = value.to(self.topo.device, copy=True)  # NCCL reduces only device tensors
            with self.timer.section("dp_comm"):
                comm.all_reduce(value, group=group, detail="eval loss")
            value /= self.topo.dp
        return self._host_float(value, "dp" if self.topo.dp > 1 else self._tp_or_local, "eval loss")

    @property
    def _tp_or_local(self) -> str:
        """The group a loss computed on this rank waits on: tensor parallelism's collectives, if any."""
        return "tp" if self.topo.tp > 1 else "local"

    def _host_float(self, value: torch.Tensor, group: str, detail: str) -> float:
        """float(value), marked as a wait on `group`: on NCCL a collective returns at once, and a rank
        that never joins it shows here, where the host first needs the result."""
        with self.topo.watchdog.waiting(group, "host sync", detail):
            return float(value)

    def _agree(self, mine: list[float]) -> list[list[float]]:
        """Every rank's `mine`, in rank order, on every rank: the step's one world-wide collective.

        It carries each rank's loss and gradient norm (the bad-step checks), the stop signal, rank 0's
        checkpoint clock, the rank's compute time (the straggler check) and its measured peak memory at
        startup and in the steps (metrics.jsonl). Every rank decides from the same gathered numbers, so all
        take the same branch, and agreeing costs no extra collective.
        """
        if not dist.is_initialized() or self.topo.world_size == 1:
            return [mine]
        local = torch.tensor(mine, dtype=torch.float64, device=self.topo.device)
        gathered = torch.empty(self.topo.world_size * len(mine), dtype=local.dtype, device=local.device)
        detail = "step agreement: bad step / stop / checkpoint clock / step times"
        comm.all_gather_single(gathered, local, detail=detail)
        with self.topo.watchdog.waiting("world", "host sync", detail):
            return gathered.view(self.topo.world_size, len(mine)).tolist()

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
        self.data_position = extra.get("data_position")
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.good_losses.extend(extra.get("good_losses", []))

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "data_position": self.data.position(self.consumed_samples),
            "skipped_steps": self.skipped_steps,
            "good_losses": list(self.good_losses),
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
        self._last_save_time = time.monotonic()

    def evaluate(self) -> float:
        losses = [
            self.runner.eval_step(batch) for batch in self.data.eval_batches(self.job.train.eval_batches)
        ]
        return self._mean_over_dp(torch.stack(losses).mean())

    def _skip_reason(self, loss: float, grad_norms: list[float]) -> tuple[str | None, bool]:
        """Why this step's update is skipped (None: it is not), and whether the skip counts toward
        train.max_bad_steps. `loss` is the step's mean over ranks, `grad_norms` every rank's norm."""
        if not math.isfinite(loss):
            return ("nan loss" if math.isnan(loss) else "inf loss"), True
        bad_norm = next((norm for norm in grad_norms if not math.isfinite(norm)), None)
        if bad_norm is not None:
            kind = "nan grad" if math.isnan(bad_norm) else "inf grad"
            scale = getattr(self.optimizer, "loss_scale", None)
            if scale is not None and not self.optimizer.loss_scale_at_minimum:
                # Dynamic loss scaling overflows by design (it probes for the largest safe scale).
                return f"{kind}: fp16 overflow at loss scale {scale:g}", False
            return kind, True
        train = self.job.train
        if train.loss_spike_factor > 0 and len(self.good_losses) == train.loss_spike_window:
            mean = sum(self.good_losses) / len(self.good_losses)
            if mean > 0 and loss > train.loss_spike_factor * mean:
                ratio, steps = loss / mean, len(self.good_losses)
                return f"loss spike {ratio:.1f}x the mean of the last {steps} good steps", True
        return None, False

    def _train_step(self, batches: Iterator[torch.Tensor]) -> dict[str, Any]:
        """One optimizer step, or a skipped one (see _skip_reason); returns what gets logged."""
        train = self.job.train
        step, rank = self.step + 1, self.topo.rank
        start = time.perf_counter()
        self.topo.watchdog.at_step(step)
        with self.topo.watchdog.waiting("local", "data-loader fetch", f"step {step}"):
            batch = next(batches)
        data_time = time.perf_counter() - start
        slow = injected("slow_rank", step=step, rank=rank)
        if slow is not None:
            time.sleep(float(slow.params.get("seconds", "1")))
        lr = learning_rate(train, self.step)
        mtp_weight = None
        if self.job.model.mtp_layers:
            tokens = self.consumed_samples * self.tokens_per_sample
            mtp_weight = mtp_loss_weight(self.job.model, tokens)
            set_mtp_loss_weight(self.model, mtp_weight)
        loss = self.runner.train_step(batch, self.timer)
        router = getattr(self.runner, "router_figures", None)
        mtp = getattr(self.runner, "mtp_losses", None)
        local_loss = _with_loss_faults(self._host_float(loss, self._tp_or_local, "step loss"), step, rank)
        # This rank's own time: the waits for the others start with the gradient reduction below.
        compute_time = time.perf_counter() - start
        inf_grad = injected("inf_grad", step=step, rank=rank) is not None
        with self.timer.section("optimizer"):
            local_norm = self.optimizer.prepare(inject_inf=inf_grad)
        mine = [local_loss, local_norm, float(self.stop.signum), float(self._clock_says_save()), compute_time]
        # The step's own peak is complete here but for the optimizer update, whose state exists from step 1.
        mine += [float(self.memory.peak_bytes()), float(self.memory.startup_bytes or 0)]
        mine += mtp.tolist() if mtp is not None else []  # per depth, after the fixed columns
        with self.timer.section("agree"):
            rows = self._agree(mine)
        columns = [list(column) for column in zip(*rows, strict=True)]
        self.stop_signal, self.save_clock_due = int(max(columns[_STOP])), bool(max(columns[_SAVE_CLOCK]))
        # Every rank of a data-parallel replica holds the replica's loss (pipeline stages get it from the
        # last one), so the mean over all ranks is the mean over the replicas.
        mean_loss = sum(columns[_LOSS]) / len(rows)
        grad_norm = next((norm for norm in columns[_GRAD_NORM] if not math.isfinite(norm)), local_norm)
        reason, counts = self._skip_reason(mean_loss, columns[_GRAD_NORM])
        with self.timer.section("optimizer"):
            if reason is None:
                stats = self.optimizer.apply(lr, local_norm)
            else:
                stats = self.optimizer.skip(local_norm, overflow=not math.isfinite(grad_norm))
            self.optimizer.zero_grad()
        if reason is None:
            self.bad_steps_in_a_row = 0
            self.good_losses.append(mean_loss)
            if router is not None and self.job.model.bias_update_rate:
                self._update_router_bias(router.expert_load)
        else:
            self.skipped_steps += 1
            self.bad_steps_in_a_row += int(counts)
            self.last_skip_reason = reason
        self.step += 1
        self.consumed_samples += train.global_batch_size
        return {
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_scale": stats.loss_scale,
            "skipped_steps": self.skipped_steps,
            "skip_reason": reason,
            "rank_step_times": columns[_COMPUTE_TIME],
            "rank_peak_memory": columns[_PEAK_MEMORY],
            "rank_startup_memory": columns[_STARTUP_MEMORY]
            if self.memory.startup_bytes is not None
            else None,
            "memory_source": self.memory.source,
            "samples": train.global_batch_size,
            "tokens": train.global_batch_size * self.tokens_per_sample,
            "step_time": time.perf_counter() - start,
            "data_time": data_time,
            "breakdown": self.timer.pop(),
            # This rank's routers (a mixture of experts only): one data-parallel replica's view of the step.
            **(router.metrics() if router is not None else {}),
            # Multi-token prediction: each depth's cross-entropy, the mean over the replicas as the loss.
            **(
                {
                    "mtp_loss": [sum(c) / len(rows) for c in columns[_STARTUP_MEMORY + 1 :]],
                    "mtp_weight": mtp_weight,
                }
                if mtp is not None
                else {}
            ),
        }

    def _update_router_bias(self, load: torch.Tensor) -> None:
        """After an applied step: move the routers' score biases toward balance by the step's expert load
        summed over the data-parallel replicas, so that every replica makes the same update."""
        group = self.topo.dp_group
        if group is not None and self.topo.dp > 1:
            load = load.to(self.topo.device, copy=True)  # NCCL reduces only device tensors
            with self.timer.section("dp_comm"):
                comm.all_reduce(load, group=group, detail="expert load")
        if hasattr(self.model, "router_rows"):  # pipeline stages: the figures hold every stage's layers
            load = load[self.model.router_rows()]
        update_score_bias(self.model.routers(), load, self.job.model.bias_update_rate)

    def _diverged(self) -> TrainingDiverged:
        """The error that stops a run after train.max_bad_steps bad steps in a row."""
        kept = self.checkpointer.last_good
        where = f"the last good checkpoint {kept} is kept" if kept else "no checkpoint had been saved yet"
        return TrainingDiverged(
            f"{self.bad_steps_in_a_row} steps in a row were skipped (the last at step {self.step}: "
            f"{self.last_skip_reason}); stopping, {where}. Lower train.lr, or raise train.max_bad_steps "
            "(or train.loss_spike_factor for spikes), and rerun the same command to resume."
        )

    def fit(self) -> TrainResult:
        """Train from the current step until train.steps, evaluating and checkpointing on schedule.

        A SIGINT or SIGTERM ends training after the step it arrived in, with a checkpoint of that step.
        """
        train = self.job.train
        first_step = self.step
        start = time.perf_counter()
        self._last_save_time = time.monotonic()
        batches = self.data.train_batches(self.consumed_samples, self.data_position)
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
                    if self.bad_steps_in_a_row >= train.max_bad_steps:
                        raise self._diverged()
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
            checkpoint=str(self.checkpointer.last_good) if self.checkpointer.last_good else None,
        )
