"""Presenting plans: the ranked table, JSON records, the breakdown plot and the winning config as YAML.

Files are written whole or not at all (a temporary file beside the target, then one rename), and an existing
file is replaced only when the caller says so: a config the user edited is never silently overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtrain.config import ConfigError, to_dict, validate
from llmtrain.config.loader import dump_yaml
from llmtrain.config.schema import JobConfig
from llmtrain.planner.choices import parallelism_notes
from llmtrain.planner.cost_model import GIB, Estimate, Layout, with_layout
from llmtrain.planner.memory import shard_group
from llmtrain.planner.search import PlanResult

COLUMNS = (
    "#",
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "mb",
    "schedule",
    "recomp",
    "sp",
    "zero",
    "step_s",
    "TFLOP/s",
    "MFU",
    "mem_GiB",
    "bubble",
    "compute",
    "TP",
    "CP",
    "EP",
    "PP",
    "DP",
    "DP_exp",
    "optim",
    "fits",
)


def _cp(lay: Layout) -> str:
    """The context-parallel degree with its attention: 16r (ring), 16a (all-to-all), or 1."""
    return f"{lay.cp}{'r' if lay.cp_comm == 'ring' else 'a'}" if lay.cp > 1 else "1"


def _row(i: int, e: Estimate) -> list[str]:
    lay = e.layout
    sched = lay.schedule + (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
    return [
        str(i),
        str(lay.tp),
        str(lay.pp),
        str(lay.dp),
        _cp(lay),
        str(lay.ep),
        str(lay.micro_batch),
        sched,
        lay.recompute,
        "y" if lay.sequence_parallel else "n",
        str(lay.zero_stage),
        f"{e.step_time:.3f}",
        f"{e.tflops_per_gpu:.1f}",
        f"{100 * e.mfu:.1f}%",
        f"{e.memory_gb:.1f}",
        f"{100 * e.bubble_fraction:.1f}%",
        f"{e.compute:.3f}",
        f"{e.tp_comm:.3f}",
        f"{e.cp_comm:.3f}",
        f"{e.ep_comm:.3f}",
        f"{e.pp_bubble:.3f}",
        f"{e.dp_comm:.3f}",
        f"{e.dp_exposed:.3f}",
        f"{e.optimizer:.3f}",
        "yes" if e.fits else "NO: " + e.why,
    ]


def format_table(result: PlanResult, top: int = 10) -> str:
    """The ranked table with a header line saying what was searched and how."""
    rows = [list(COLUMNS)] + [_row(i + 1, e) for i, e in enumerate(result.ranked[:top])]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS) - 1)]
    lines = ["  ".join([cell.rjust(w) for cell, w in zip(r, widths, strict=False)] + [r[-1]]) for r in rows]
    w = result.workload
    head = (
        f"{result.gpus} x {result.cluster_name}, global batch {w.global_batch} x {w.seq} tokens, "
        f"{w.precision}; "
        f"{result.method} search, {result.evaluated} layouts evaluated in {result.seconds:.3f} s. "
        "Times in seconds per step (compute/TP/CP/EP/PP/DP columns: busiest rank; CP = exposed context-"
        "parallel traffic, EP = expert all-to-alls; DP = total, DP_exp = exposed); cp: r ring, a all-to-all; "
        "TFLOP/s counts recomputation, MFU does not."
    )
    if result.pruned:
        reasons = "; ".join(f"{why} (x{n})" for why, n in result.pruned.most_common(5))
        head += f"\nPruned: {reasons}"
    notes = [f"Why {note}" for note in parallelism_notes(result)]
    return head + "\n" + "\n".join(lines + notes)


_MEMORY_ROWS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer state"),
    ("activations", "activations"),
    ("gathered", "gathered buffers"),
    ("buffers", "communication buffers"),
    ("reserved", "reserved"),
)


def _state_notes(lay: Layout, precision: str) -> dict[str, str]:
    """What each model-state row holds for this layout (llmtrain.planner.memory's table)."""
    shard = shard_group(lay)
    over = f" / {shard}" if lay.zero_stage else ""
    if lay.zero_stage and lay.ep > 1:
        over += f" (routed experts / {max(shard // lay.ep, 1)})"
    weight = "fp32" if precision == "fp32" else precision
    master = "Adam m, v" if precision == "fp32" else "fp32 master + Adam m, v"
    notes = {
        "params": f"{weight} weights" if lay.zero_stage < 3 else f"fp32 shard{over} (also the master)",
        "grads": "fp32 main gradients" + (over if lay.zero_stage >= 2 else ""),
        "optimizer": (
            master
            if lay.zero_stage < 2
            else "fp32 master + Adam m, v"
            if lay.zero_stage == 2
            else "Adam m, v"
        )
        + over,
        "activations": f"recompute {lay.recompute}, micro-batches in flight under {lay.schedule}, logits",
        "gathered": "unsharded blocks in flight (ZeRO-2/3)" if lay.zero_stage >= 2 else "none below ZeRO-2",
        "buffers": "pipeline sends, DP buckets, SP gather",
        "reserved": "runtime context, workspaces (cluster file)",
    }
    for row in {
        "optimizer": ("optimizer", "grads"),
        "optimizer+params": ("optimizer", "grads", "params"),
    }.get(lay.offload, ()):
        notes[row] += " -> offloaded to host"
    return notes


def format_memory(e: Estimate, precision: str, device: str) -> str:
    """The fullest rank's memory of one layout: each part, steady state, startup peak, peak against the
    device's capacity, and what lives on the host."""
    mem, cap = e.memory, e.capacity / GIB
    notes = _state_notes(e.layout, precision)
    lines = [f"memory per rank (the fullest): {e.layout.short()}, {precision}, on {device} ({cap:g} GiB)"]
    for key, label in _MEMORY_ROWS:
        lines.append(f"  {label:<22}{mem[key] / GIB:>9.2f} GiB   {notes[key]}")
    lines.append("  " + "-" * 33)
    lines.append(f"  {'steady state':<22}{mem['steady'] / GIB:>9.2f} GiB   during training steps")
    lines.append(
        f"  {'startup peak':<22}{mem['startup'] / GIB:>9.2f} GiB   while the model is built and sharded"
    )
    verdict = "fits" if e.fits else "DOES NOT FIT: " + e.why
    lines.append(
        f"  {'peak':<22}{mem['total'] / GIB:>9.2f} GiB   "
        f"{100 * mem['total'] / e.capacity:.0f}% of {cap:g} GiB: {verdict}"
    )
    if mem["host"]:
        lines.append(f"  {'host (offloaded)':<22}{mem['host'] / GIB:>9.2f} GiB   in CPU memory, per rank")
    return "\n".join(lines)


def to_records(result: PlanResult, top: int = 10) -> list[dict]:
    """The top estimates as JSON-ready dicts (fields of Layout plus step_time_s, tflops_per_gpu, mfu, ...)."""
    return [e.as_dict() for e in result.ranked[:top]]


def check_new_file(path: str | Path, overwrite: bool = False) -> Path:
    """`path` as a Path, after checking that writing it replaces nothing unless `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; choose another path, or pass --overwrite to replace it")
    return path


def write_file(path: str | Path, write: Callable[[Path], Any], overwrite: bool = False) -> None:
    """Create `path` by `write(temporary path)` and one rename (missing folders are made), so readers never
    see half a file; an existing file is replaced only with `overwrite`."""
    path = check_new_file(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder (the rename stays on one file system) and same suffix (matplotlib picks the format by it).
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_yaml(data: Any, path: str | Path, overwrite: bool = False) -> None:
    """Write `data` as YAML that llmtrain's loaders read back unchanged (see write_file)."""
    text = dump_yaml(data)
    write_file(path, lambda tmp: tmp.write_text(text), overwrite)


def write_config(
    job: JobConfig,
    estimate: Estimate,
    path: str | Path,
    global_batch: int | None = None,
    overwrite: bool = False,
    dp_micro_batches: Sequence[int] = (),
) -> JobConfig:
    """Write `job` running the estimate's layout (and `dp_micro_batches`, a heterogeneous plan's
    micro-batches per replica) as a YAML that llmtrain.config.load accepts."""
    best = with_layout(job, estimate.layout, global_batch)
    best = replace(best, train=replace(best.train, dp_micro_batches=list(dp_micro_batches)))
    validate(best)
    write_yaml(to_dict(best), path, overwrite)
    return best


def _label(lay: Layout) -> str:
    """Three short lines naming a layout under its bar."""
    sched = {"interleaved_1f1b": f"int/v{lay.virtual_stages}", "zb_h1": "zb-h1"}.get(
        lay.schedule, lay.schedule
    )
    return (
        f"{lay.tp}/{lay.pp}/{lay.dp} mb{lay.micro_batch}"
        + (f" cp{_cp(lay)}" if lay.cp > 1 else "")
        + (f" ep{lay.ep}" if lay.ep > 1 else "")
        + f"\n{sched}\n"
        f"rc={lay.recompute[:4]}{' sp' if lay.sequence_parallel else ''} z{lay.zero_stage}"
    )


def plot(result: PlanResult, path: str | Path, top: int = 10, overwrite: bool = False) -> None:
    """Bar charts of the top layouts' step-time and memory breakdowns, written to `path` (png/pdf/svg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ests = result.ranked[:top]
    labels = [f"#{i + 1}\n{_label(e.layout)}" for i, e in enumerate(ests)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ests) + 4), 5.5))
    parts = {
        "compute": [e.compute for e in ests],
        "TP comm": [e.tp_comm for e in ests],
        "CP comm": [e.cp_comm for e in ests],
        "EP comm": [e.ep_comm for e in ests],
        "pipeline bubble": [e.pp_bubble for e in ests],
        "DP exposed": [e.dp_exposed for e in ests],
        "optimizer": [e.optimizer for e in ests],
    }
    bottom = [0.0] * len(ests)
    for name, vals in parts.items():
        ax_t.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_t.set_ylabel("seconds per step")
    ax_t.set_title("step time (tp/pp/dp)")
    ax_t.legend(fontsize=8)
    bottom = [0.0] * len(ests)
    for name in ("params", "grads", "optimizer", "activations", "buffers", "reserved"):
        vals = [e.memory[name] / GIB for e in ests]
        ax_m.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if ests:
        ax_m.axhline(ests[0].capacity / GIB, color="k", linestyle="--", label="device memory")
    ax_m.set_ylabel("GiB per GPU")
    ax_m.set_title("memory on the fullest rank")
    ax_m.legend(fontsize=8)
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    try:
        write_file(path, fig.savefig, overwrite)
    finally:
        plt.close(fig)
