"""Step metrics of a run: one compact console line, `metrics.jsonl`, TensorBoard and (logging.wandb)
Weights & Biases, all from rank 0.

The trainer calls `log_step` after every optimizer step; the logger aggregates the steps of each
logging interval (the loss is their mean, throughput total tokens over total step time) and writes an
entry at every `logging.interval`-th step, at the last one, at a step where training stops early, and at
every skipped step (its row says why in `skip_reason`). Each entry has the spread over ranks of their
compute time per step, and the progress line names the ranks slower than train.straggler_factor times the
median.
metrics.jsonl is only appended to, each row tagged with this launch's `segment` (see
llmtrain.training.metrics_file); nothing is created before the first entry. Other ranks construct the
logger with is_main=False and it writes nothing.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from llmtrain.config import JobConfig
from llmtrain.training.metrics_file import METRICS_FILE
from llmtrain.training.peak import Peak, device_peak

# JSONL key -> TensorBoard tag; keys absent from an entry (or None) are not written.
# Logged for a mixture of experts only (trainer.RouterFigures.metrics): this step's, from rank 0's routers.
MOE_METRICS = (
    "aux_loss",
    "z_loss",
    "dropped_fraction",
    "expert_load_max",
    "expert_load_mean",
    "expert_load_layers",
)
# Logged with model.mtp_layers: the mean over the interval's applied steps of each depth's cross-entropy
# (a list, depth 1 first; TensorBoard train/mtp_loss_<k>) and this step's loss weight lambda.
MTP_METRICS = ("mtp_loss", "mtp_weight")
_TB_TAGS = {
    "loss": "train/loss",
    "loss_avg": "train/loss_avg",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "skipped_steps": "train/skipped_steps",
    "tokens_per_sec": "perf/tokens_per_sec",
    "samples_per_sec": "perf/samples_per_sec",
    "step_time_s": "perf/step_time_s",
    "rank_step_time_min_s": "perf/rank_step_time_min_s",
    "rank_step_time_median_s": "perf/rank_step_time_median_s",
    "rank_step_time_max_s": "perf/rank_step_time_max_s",
    "data_time_s": "perf/data_time_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "peak_memory_gb": "perf/peak_memory_gb",
    "aux_loss": "moe/aux_loss",
    "z_loss": "moe/z_loss",
    "dropped_fraction": "moe/dropped_fraction",
    "expert_load_max": "moe/expert_load_max",
    "expert_load_mean": "moe/expert_load_mean",
    "mtp_weight": "train/mtp_weight",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}


def scalars(entry: dict[str, Any]) -> dict[str, float]:
    """An entry's scalars by TensorBoard tag (W&B gets the same): the keys of _TB_TAGS and every
    `time_<section>_s` as `time/<section>`, and the MTP loss of each depth as `train/mtp_loss_<k>`; absent
    and None values are left out."""
    out = {}
    for key, value in entry.items():
        tag = _TB_TAGS.get(key) or (f"time/{key[5:-2]}" if key.startswith("time_") else None)
        if tag is not None and value is not None:
            out[tag] = value
    for depth, value in enumerate(entry.get("mtp_loss") or [], start=1):
        out[f"train/mtp_loss_{depth}"] = value
    return out


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf; a non-finite number is written as null (the step is counted as skipped)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def rank_time_spread(window: list[dict[str, Any]], straggler_factor: float) -> dict[str, Any]:
    """Each rank's mean compute time per step over `window` (values with `rank_step_times`): its minimum,
    median and maximum over ranks, the slowest rank, and `slow_ranks` {rank: times the median} for those
    over `straggler_factor` times the median (0 names none). The median is the lower one, so with two
    ranks a slow one is compared with the other, not with the midpoint of the two."""
    per_step = [v["rank_step_times"] for v in window if v.get("rank_step_times")]
    if not per_step:
        return {}
    means = [sum(column) / len(column) for column in zip(*per_step, strict=True)]
    median = statistics.median_low(means)
    slow = {}
    if straggler_factor > 0 and median > 0:
        slow = {str(r): t / median for r, t in enumerate(means) if t > straggler_factor * median}
    return {
        "rank_step_time_min_s": min(means),
        "rank_step_time_median_s": median,
        "rank_step_time_max_s": max(means),
        "slowest_rank": means.index(max(means)),
        "slow_ranks": slow,
    }


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process in GiB: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def memory_entry(values: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The memory fields of an entry: every rank's measured peak in the training steps so far
    (`rank_peak_memory_gb`, by rank) and at startup (`rank_startup_memory_gb`, when measured), the largest
    step peak as `peak_memory_gb`, and what measured them (llmtrain.training.memory_tracking). Without
    per-rank figures (a logger driven directly), this process's peak_memory_gb alone."""
    ranks = values.get("rank_peak_memory")
    if not ranks:
        return {"peak_memory_gb": peak_memory_gb(device)}
    startup = values.get("rank_startup_memory")
    return {
        "peak_memory_gb": max(ranks) / 2**30,
        "rank_peak_memory_gb": [b / 2**30 for b in ranks],
        "rank_startup_memory_gb": [b / 2**30 for b in startup] if startup else None,
        "memory_source": values.get("memory_source"),
    }


def format_duration(seconds: float) -> str:
    """Compact h/m/s form for ETAs: 3725 -> '1h02m05s'."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class MetricsLogger:
    """Rank-0 metrics: console line per logging interval, metrics.jsonl, TensorBoard and W&B scalars.

    MFU = flops_per_token x tokens/s / (world_size x dense peak FLOP/s of one device at
    train.precision), shown only when the peak is known (see llmtrain.training.peak); `tokens` passed
    to log_step are the whole job's tokens of that step.
    """

    def __init__(
        self,
        job: JobConfig,
        is_main: bool,
        flops_per_token: float,
        world_size: int,
        *,
        segment: int = 0,
        device: torch.device | str | None = None,
        peak: Peak | None = None,
        stream: TextIO | None = None,
    ) -> None:
        if flops_per_token <= 0:
            raise ValueError(f"flops_per_token must be positive; got {flops_per_token}")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1; got {world_size}")
        self.is_main = is_main
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.segment = segment
        self.total_steps = job.train.steps
        self.interval = job.logging.interval
        self.straggler_factor = job.train.straggler_factor
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.stream = stream if stream is not None else sys.stdout
        self.start_time = time.perf_counter()
        self.job = job
        self.output_dir = Path(job.output_dir)
        self.tensorboard = job.logging.tensorboard
        self.last_loss_avg: float | None = None
        """Mean finite loss of the last logged interval (None before the first, or if all were skipped)."""
        self._window: list[dict[str, Any]] = []
        self._skipped_total = 0
        self._jsonl: TextIO | None = None
        self._tb: Any = None
        self._wandb: Any = None
        self.peak: Peak | None = None
        if is_main:
            # A measured (GPU) peak is taken here, before training, so the benchmark never competes
            # with this job's own compute.
            self.peak = peak or device_peak(job.train.precision, self.device, job.logging.peak_tflops)

    def start(self) -> None:
        """Open the W&B run (logging.wandb.project) on rank 0; called once the launch is committed, so that
        a W&B problem stops the launch before its first step."""
        if self.is_main and self.job.logging.wandb.project is not None:
            from llmtrain.training.wandb_run import WandbRun

            self._wandb = WandbRun.open(self.job)

    def should_log(self, step: int) -> bool:
        """Whether `step` (1-based, counted after the optimizer step) gets an entry."""
        return step % self.interval == 0 or step == self.total_steps

    def log_step(self, step: int, values: dict[str, Any], *, last: bool = False) -> None:
        """Record one finished step; writes an entry on logging steps and when `last` (training stops here).

        values: loss, lr, grad_norm, loss_scale (None without fp16), skipped (bool, this step) or
        skipped_steps (running count), skip_reason (why this step's update was skipped, or None), tokens
        and samples (whole job, this step), step_time and data_time (seconds), optional breakdown
        {section: seconds} from StepTimer.pop(), rank_step_times (every rank's compute time, by rank) and
        rank_peak_memory / rank_startup_memory (every rank's measured peak bytes) with memory_source,
        for a mixture of experts the MOE_METRICS of this step, and with multi-token prediction mtp_loss
        (this step's cross-entropy per depth) and mtp_weight.
        """
        if not self.is_main:
            return
        for key in ("tokens", "samples", "step_time"):
            if key not in values:
                raise KeyError(f"MetricsLogger.log_step needs values[{key!r}]; got keys {sorted(values)}")
        if "skipped_steps" in values:
            self._skipped_total = int(values["skipped_steps"])
        else:
            self._skipped_total += int(bool(values.get("skipped", False)))
        self._window.append(values)
        if last or self.should_log(step) or values.get("skip_reason"):
            self._write_train(step, values)
            self._window = []

    def _write_train(self, step: int, current: dict[str, Any]) -> None:
        window = self._window
        step_time = sum(v["step_time"] for v in window)
        tokens_per_sec = sum(v["tokens"] for v in window) / step_time if step_time > 0 else 0.0
        samples_per_sec = sum(v["samples"] for v in window) / step_time if step_time > 0 else 0.0
        achieved = self.flops_per_token * tokens_per_sec / self.world_size
        mean_step = step_time / len(window)
        finite_losses = [
            v["loss"]
            for v in window
            if v.get("loss") is not None and math.isfinite(v["loss"]) and not v.get("skip_reason")
        ]
        self.last_loss_avg = sum(finite_losses) / len(finite_losses) if finite_losses else None
        entry: dict[str, Any] = {
            "step": step,
            "segment": self.segment,
            "loss": current.get("loss"),
            "loss_avg": self.last_loss_avg,
            "lr": current.get("lr"),
            "grad_norm": current.get("grad_norm"),
            "loss_scale": current.get("loss_scale"),
            "skipped_steps": self._skipped_total,
            "skip_reason": current.get("skip_reason"),
            "tokens_per_sec": tokens_per_sec,
            "samples_per_sec": samples_per_sec,
            "step_time_s": mean_step,
            "data_time_s": sum(v.get("data_time", 0.0) for v in window) / len(window),
            "tflops_per_device": achieved / 1e12,
            "mfu": achieved / self.peak.flops if self.peak is not None else None,
            "mfu_peak": self.peak.source if self.peak is not None else None,
            **memory_entry(current, self.device),
            "elapsed_s": time.perf_counter() - self.start_time,
            "eta_s": mean_step * max(self.total_steps - step, 0),
            **rank_time_spread(window, self.straggler_factor),
        }
        breakdown: dict[str, float] = {}
        for values in window:
            for name, seconds in values.get("breakdown", {}).items():
                breakdown[name] = breakdown.get(name, 0.0) + seconds
        for name, seconds in breakdown.items():
            entry[f"time_{name}_s"] = seconds / len(window)
        entry |= {key: current[key] for key in MOE_METRICS if key in current}
        if "mtp_loss" in current:
            kept = [v["mtp_loss"] for v in window if "mtp_loss" in v and not v.get("skip_reason")]
            depths = [sum(d) / len(kept) for d in zip(*kept, strict=True)] if kept else None
            entry |= {"mtp_loss": depths, "mtp_weight": current["mtp_weight"]}
        self._emit(entry)
        self._print_line(entry)

    def log_eval(self, step: int, eval_loss: float) -> None:
        """Record a held-out evaluation at `step`."""
        if not self.is_main:
            return
        ppl = math.exp(eval_loss) if eval_loss < 700 else math.inf  # exp overflows a double past ~709
        self._emit(
            {
                "step": step,
                "segment": self.segment,
                "eval_loss": eval_loss,
                "eval_ppl": ppl,
                "elapsed_s": time.perf_counter() - self.start_time,
            }
        )
        self.note(f"eval step {step}/{self.total_steps} | loss {eval_loss:.4f} | ppl {ppl:.2f}")

    def note(self, message: str) -> None:
        """A line on rank 0's console (progress, checkpoint saved, ...); safe from a background thread."""
        if self.is_main:
            self.stream.write(message + "\n")  # one write: lines from two threads never interleave
            self.stream.flush()

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the files and the W&B run, which `exit_code` marks finished or failed (safe to
        call twice)."""
        if self._wandb is not None:
            self._wandb.finish(exit_code)
            self._wandb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _emit(self, entry: dict[str, Any]) -> None:
        """Append an entry to metrics.jsonl and TensorBoard (opened at the first entry)."""
        if self._jsonl is None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (self.output_dir / METRICS_FILE).open("a")
            if self.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._jsonl.write(json.dumps({k: _finite_or_none(v) for k, v in entry.items()}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for tag, value in scalars(entry).items():
                self._tb.add_scalar(tag, value, entry["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars(entry), entry["step"])

    def _print_line(self, e: dict[str, Any]) -> None:
        width = len(str(self.total_steps))
        parts = [f"step {e['step']:>{width}}/{self.total_steps}"]
        parts.append("loss " + (f"{e['loss_avg']:.4f}" if _is_number(e["loss_avg"]) else "-"))
        if e["lr"] is not None:
            parts.append(f"lr {e['lr']:.2e}")
        if _is_number(e["grad_norm"]):
            parts.append(f"grad {e['grad_norm']:.3f}")
        if e["loss_scale"] is not None:
            parts.append(f"scale {e['loss_scale']:g}")
        if e["skip_reason"]:
            parts.append(f"skipped {e['skipped_steps']} (this step: {e['skip_reason']})")
        elif e["skipped_steps"]:
            parts.append(f"skipped {e['skipped_steps']}")
        if e.get("slow_ranks"):
            median_ms = 1e3 * e["rank_step_time_median_s"]
            slow = ", ".join(f"{rank} ({ratio:.1f}x)" for rank, ratio in e["slow_ranks"].items())
            parts.append(f"slow rank {slow} vs median {median_ms:.0f} ms")
        if "aux_loss" in e:
            load = e["expert_load_max"] / e["expert_load_mean"]
            parts.append(f"aux {e['aux_loss']:.3f}")
            if "z_loss" in e:
                parts.append(f"z {e['z_loss']:.3g}")
            if e.get("dropped_fraction"):
                parts.append(f"dropped {100 * e['dropped_fraction']:.1f}%")
            parts.append(f"expert load max/mean {load:.2f}")
        if e.get("mtp_loss"):
            parts.append("mtp " + "/".join(f"{v:.4f}" for v in e["mtp_loss"]))
        parts.append(f"{_si(e['tokens_per_sec'])} tok/s")
        parts.append(f"{e['tflops_per_device']:.3g} TFLOP/s/dev")
        if e["mfu"] is not None:
            measured = " of measured peak" if self.peak is not None and self.peak.measured else ""
            parts.append(f"MFU {100 * e['mfu']:.1f}%{measured}")
        parts.append(f"mem {e['peak_memory_gb']:.2f} GiB")
        parts.append(f"ETA {format_duration(e['eta_s'])}")
        self.note(" | ".join(parts))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _si(value: float) -> str:
    """12345.6 -> '12.3k': throughput figures span many orders of magnitude."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"
