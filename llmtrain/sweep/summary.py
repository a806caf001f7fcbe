"""A sweep's results as summary.csv, summary.md (a markdown table) and PNG plots."""

from __future__ import annotations

import csv
import io
import math
import statistics
from pathlib import Path
from typing import Any

from llmtrain.sweep.runner import RunResult, replace_atomically, write_atomic
from llmtrain.training.metrics_file import row_kind

PLOTS = ("final_loss.png", "tokens_per_sec.png", "loss_curves.png")


def _train_rows(result: RunResult) -> list[dict[str, Any]]:
    """The run's training rows in step order, one per step (result.metrics is already latest-per-step)."""
    return [row for row in result.metrics if row_kind(row) == "train"]


def loss_curve(result: RunResult) -> list[tuple[int, float]]:
    """(step, training loss) as plotted: one point per step, from the row written last for it."""
    return [(row["step"], row["loss"]) for row in _train_rows(result) if row.get("loss") is not None]


def result_row(result: RunResult) -> dict[str, Any]:
    """Headline figures of one run from its metrics.jsonl rows (the latest row per step).

    tokens/s, TFLOP/s per device and MFU are the median over the logged intervals after the first of each
    launch (segment), which carries the warm-up (allocation, first-call kernel selection); with no others,
    those are used.
    """
    train = _train_rows(result)
    evals = [e for e in result.metrics if e.get("eval_loss") is not None]
    first_of_segment: dict[int, int] = {}
    for row in train:
        first_of_segment.setdefault(row.get("segment", 0), row["step"])
    steady = [row for row in train if row["step"] != first_of_segment[row.get("segment", 0)]] or train
    last = train[-1] if train else {}

    def median(key: str) -> float | None:
        values = [e[key] for e in steady if e.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "run": result.name,
        **result.overrides,
        "status": result.status,
        "steps": last.get("step"),
        "final_loss": last.get("loss"),
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_sec": median("tokens_per_sec"),
        "tflops_per_device": median("tflops_per_device"),
        "mfu": median("mfu"),
        "peak_memory_gb": last.get("peak_memory_gb"),
        "duration_s": round(result.duration_s, 1),
        "error": result.error or "",
    }


def _cell(value: Any, key: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if key == "mfu":
        return f"{100 * value:.2f}%"
    if isinstance(value, float):
        return f"{value:.4g}" if key != "tokens_per_sec" else f"{value:.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a GitHub markdown table (every key as a column, in first-seen order)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c), c) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _plot(results: list[RunResult], rows: list[dict[str, Any]], output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [row["run"] for row in rows]
    paths = []
    for key, title, filename in (
        ("final_loss", "final training loss", PLOTS[0]),
        ("tokens_per_sec", "tokens/s (median after the first interval)", PLOTS[1]),
    ):
        values = [row[key] if row[key] is not None else 0.0 for row in rows]
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
        colors = ["tab:blue" if row["status"] == "done" else "tab:red" for row in rows]
        bars = ax.barh(names, values, color=colors)
        for bar, row in zip(bars, rows, strict=True):
            label = "failed" if row["status"] != "done" else _cell(row[key], key)
            ax.annotate(
                label,
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.invert_yaxis()  # first run on top, as in the table
        ax.set_title(title)
        fig.tight_layout()
        paths.append(_save_png(fig, output / filename))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        curve = loss_curve(result)
        if curve:
            ax.plot(*zip(*curve, strict=True), marker=".", label=result.name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save_png(fig, output / PLOTS[2]))
    plt.close(fig)
    return paths


def _save_png(fig: Any, path: Path) -> Path:
    """Save a figure as PNG, never leaving `path` half-written."""
    replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    return path


def summarize(results: list[RunResult], output: str | Path) -> str:
    """Write summary.csv, summary.md and the plots into `output`; return the markdown table."""
    output = Path(output)
    rows = [result_row(r) for r in results]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(output / "summary.csv", buffer.getvalue())
    table = markdown_table(rows)
    done = sum(r.status == "done" for r in results)
    plots = _plot(results, rows, output)
    text = (
        f"# Sweep summary\n\n{done} of {len(results)} runs finished; failed runs show their error.\n\n"
        f"{table}\n\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots) + "\n"
    )
    write_atomic(output / "summary.md", text)
    return table
