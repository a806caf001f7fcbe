"""Plans as a picture: bar charts of the top layouts' step-time and memory breakdowns (matplotlib, imported
when drawing)."""

from __future__ import annotations

from pathlib import Path

from llmtrain.planner.cost.layout import GIB, Layout
from llmtrain.planner.report.files import write_file
from llmtrain.planner.report.tables import cp_label
from llmtrain.planner.search.uniform import PlanResult


def _label(lay: Layout) -> str:
    """Three short lines naming a layout under its bar."""
    sched = {"interleaved_1f1b": f"int/v{lay.virtual_stages}", "zb_h1": "zb-h1"}.get(
        lay.schedule, lay.schedule
    )
    return (
        f"{lay.tp}/{lay.pp}/{lay.dp} mb{lay.micro_batch}"
        + (f" cp{cp_label(lay)}" if lay.cp > 1 else "")
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
