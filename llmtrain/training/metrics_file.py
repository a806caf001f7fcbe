"""The metrics.jsonl format, for its writer and every reader.

The file is append-only: each launch of a run in an output directory (the first, a resume after an
interrupt, an elastic restart) appends rows tagged with its `segment` number (0 for the first launch).
A resumed run may redo steps an earlier segment already logged (those after its last checkpoint), so
readers take, for each step and kind of row, the row written last: `latest_per_step`.
Imports no torch, so sweeps and plots read metrics without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl in file order; a line cut short by a crash is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def row_kind(row: dict[str, Any]) -> str:
    """'eval' for an evaluation row, 'train' for a training row."""
    return "eval" if "eval_loss" in row else "train"


def latest_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each (step, kind) the row written last, ordered by step (train before eval at one step)."""
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        latest[(int(row["step"]), row_kind(row))] = row
    return [latest[key] for key in sorted(latest, key=lambda k: (k[0], k[1] != "train"))]


def next_segment(path: str | Path) -> int:
    """The segment number a new launch writing to `path` takes: one more than any row's, else 0."""
    segments = [int(row.get("segment", 0)) for row in read_rows(path)]
    return max(segments) + 1 if segments else 0
