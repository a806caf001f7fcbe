"""Plans as text and records: the ranked table, the memory rows of one layout, JSON-ready records."""

from __future__ import annotations

from llmtrain.planner.cost.layout import GIB, Layout
from llmtrain.planner.cost.memory import shard_group
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.report.choices import parallelism_notes
from llmtrain.planner.search.uniform import PlanResult

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


def cp_label(lay: Layout) -> str:
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
        cp_label(lay),
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
    """What each model-state row holds for this layout (llmtrain.planner.cost.memory's table)."""
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
