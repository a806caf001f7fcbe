"""Validation on this machine: the planner's predicted step time against measured gloo runs of a small model.

A small model (configs/llama-small.yaml with LOCAL_MODEL_OVERRIDES) is trained for a few steps in the
LOCAL_LAYOUTS, each measured step time being the median of the `step_time_s` entries of the run's
metrics.jsonl after the warm-up steps. The prediction is the planner's fixed-layout evaluation (every setting
given, as `tools/plan.py --evaluate`) on a cluster file describing this machine, the one
`tools/calibrate.py --output local.yaml` writes (`benchmarks/validate_planner.py --local --local-cluster
local.yaml`). One cluster and one model for every row, no per-row factors and nothing fitted on these rows;
the agreement is summarised by the per-layout error |predicted - measured| / measured, its median and max
against ERROR_TARGET (issue 19: median <= 15%), the Spearman rank correlation (does the planner order the
layouts as the machine does?) and the spread of measured/predicted ratios.

Why 1-2 processes, one core each (train.num_threads=1), although the issue allows 1-4 ranks: the machine
this runs on has 2 cores, and the planner models one device per rank that nothing else uses. Two
single-threaded processes on 2 cores match that model (the calibration divides the machine's matmul rate
and copy bandwidth between the 2 processes it describes). Three or four processes on 2 cores time-share:
the step time then depends on the OS scheduler interleaving ranks that wait on each other in gloo, a
slowdown the planner does not model, so the error would measure the oversubscription, not the planner.
Per-process CPU time would remove the time-sharing but also the waiting (pipeline bubbles, collectives)
that the planner does predict, so it is not the step time either. On a machine with 4 or more cores the
same code takes 3-4 rank layouts unchanged (calibrate with --devices 4).

Pure Python: launching the runs is the benchmark's job (benchmarks/validate_planner.py --local).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from llmtrain.planner.auto import layout_overrides
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.layout import Layout, Software, Workload
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.search.uniform import plan

LOCAL_CONFIG = "configs/llama-small.yaml"
LOCAL_MODEL_OVERRIDES = (
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.seq_length=128",
    "train.global_batch_size=16",
    "train.precision=fp32",
)
"""The small job every layout trains (global batch 16 of 128 tokens, fp32 on CPU)."""

LOCAL_LAYOUTS = (
    Layout(micro_batch=16),
    Layout(micro_batch=4),
    Layout(micro_batch=4, recompute="full"),
    Layout(micro_batch=4, recompute="selective"),
    Layout(tp=2, micro_batch=4),
    Layout(tp=2, micro_batch=4, sequence_parallel=True),
    Layout(pp=2, micro_batch=2),
    Layout(pp=2, micro_batch=8, recompute="full"),
    Layout(dp=2, micro_batch=8),
    Layout(dp=2, micro_batch=2, zero_stage=1),
    Layout(dp=2, micro_batch=4, zero_stage=2),
    Layout(dp=2, micro_batch=8, zero_stage=3),
)
"""(tp, pp, dp) in (1,1,1), (2,1,1), (1,2,1), (1,1,2) with micro-batch, recompute, SP and ZeRO 1-3."""

ERROR_TARGET = 0.15
"""Issue 19's bound on the median |predicted - measured| / measured over the local layouts."""


def run_overrides(layout: Layout, steps: int, output_dir: str) -> list[str]:
    """`key=value` overrides of tools/pretrain.py for a short timing run of `layout` (after the model's)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    items = [f"{key}={json.dumps(value) if isinstance(value, str) else value}"
             for key, value in layout_overrides(layout).items()]  # fmt: skip
    return items + [
        f"train.steps={steps}",
        "train.eval_interval=0",
        "train.num_threads=1",  # one core per process: the profiled device
        "logging.interval=1",
        "logging.tensorboard=false",
        "logging.peak_tflops=1.0",  # MFU is not used here; skips the per-run peak benchmark
        "checkpoint.interval=0",
        f"output_dir={output_dir}",
    ]


def median_step_time(lines: Iterable[str], warmup: int) -> float:
    """Median `step_time_s` of metrics.jsonl lines (one entry per step) after the first `warmup` steps."""
    times = []
    for line in lines:
        if not line.strip():
            continue
        entry = json.loads(line)
        if "step_time_s" in entry and entry["step"] > warmup and entry["step_time_s"] is not None:
            times.append(float(entry["step_time_s"]))
    if not times:
        raise ValueError(
            f"no step_time_s entries after {warmup} warm-up steps in metrics.jsonl; "
            "run more train.steps than the warm-up (with logging.interval=1)"
        )
    return statistics.median(times)


LOCAL_SOFTWARE = Software(fused_kernels=False)
"""llmtrain as it runs these layouts: on CPU, model.kernels=auto runs the PyTorch reference ops, not the
fused Triton kernels."""


def predict(workload: Workload, cluster: Cluster, layout: Layout) -> Estimate:
    """The planner's prediction for exactly `layout` (every setting fixed, pipeline simulator on)."""
    return plan(workload, cluster, layout.gpus, asdict(layout), LOCAL_SOFTWARE, top=1).ranked[0]


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of the tie-averaged ranks); nan when either side is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs sequences of equal length; got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        raise ValueError(f"spearman needs at least 2 points; got {len(xs)}")
    rx, ry = _ranks(xs), _ranks(ys)
    mean = (len(xs) + 1) / 2  # the mean of ranks 1..n, ties included
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    var_x = sum((a - mean) ** 2 for a in rx)
    var_y = sum((b - mean) ** 2 for b in ry)
    if var_x == 0 or var_y == 0:
        return math.nan
    return cov / math.sqrt(var_x * var_y)


@dataclass
class LocalPoint:
    """One layout: predicted and measured seconds per step."""

    layout: Layout
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        """Measured over predicted (1: exact; the same value on every row: perfectly scaled)."""
        return self.measured / self.predicted

    @property
    def error(self) -> float:
        """|predicted - measured| / measured: the relative error of the prediction."""
        return abs(self.predicted - self.measured) / self.measured


def local_summary(points: Sequence[LocalPoint]) -> dict[str, float]:
    """Median and max relative error, Spearman correlation of predicted vs measured, and the median/min/max
    measured/predicted ratio."""
    ratios = [p.ratio for p in points]
    errors = [p.error for p in points]
    return {
        "median_error": statistics.median(errors),
        "max_error": max(errors),
        "spearman": spearman([p.predicted for p in points], [p.measured for p in points]),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


def format_local(points: Sequence[LocalPoint]) -> str:
    """Table of layouts with predicted and measured step time and the error, then the summary lines."""
    lines = [f"{'procs':>5}  {'layout':<55} {'pred_s':>8} {'meas_s':>8} {'meas/pred':>9} {'error':>7}"]
    for p in points:
        lines.append(
            f"{p.layout.gpus:5d}  {p.layout.short():<55} {p.predicted:8.4f} {p.measured:8.4f} {p.ratio:9.2f} "
            f"{100 * p.error:6.1f}%"
        )
    s = local_summary(points)
    verdict = "meets" if s["median_error"] <= ERROR_TARGET else "misses"
    target = f"({verdict} the median <= {100 * ERROR_TARGET:.0f}% target)"
    lines.append(
        f"|predicted - measured| / measured over {len(points)} layouts: "
        f"median {100 * s['median_error']:.1f}%, max {100 * s['max_error']:.1f}% {target}"
    )
    lines.append(
        f"Spearman rank correlation {s['spearman']:+.3f} over {len(points)} layouts; measured/predicted "
        f"median {s['median_ratio']:.2f} (min {s['min_ratio']:.2f}, max {s['max_ratio']:.2f})"
    )
    return "\n".join(lines)
