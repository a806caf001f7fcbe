"""Pictures of pipeline schedules: a PNG timeline and a Chrome trace, from a simulation or a traced run.

A timeline is a list of ``Span``s (one compute action on one pipeline rank). Traces of real runs are JSON
``{"events": [{"rank", "kind", "microbatch", "chunk", "start", "end"}, ...]}`` with times in seconds, as
written by the executor's trace; simulated spans are in the simulator's cost unit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import SimulationResult, simulate

# Forward blue, full backward green, input-gradient orange, weight-gradient purple; later chunks darker.
_COLOURS = {"F": "#4c8bd6", "B": "#3aa655", "I": "#f0a030", "W": "#9467bd"}


@dataclass(frozen=True)
class Span:
    """One compute action of one pipeline rank, from ``start`` to ``end``."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


def spans_from_simulation(result: SimulationResult) -> list[Span]:
    """The compute events of a simulation as spans."""
    return [
        Span(e.rank, e.action.kind, e.action.microbatch, e.action.chunk, e.start, e.end)
        for e in result.events
        if e.action.is_compute
    ]


def save_trace(spans: Iterable[Span], path: str | Path) -> None:
    """Write spans in the trace format that ``load_trace`` reads."""
    Path(path).write_text(json.dumps({"events": [asdict(s) for s in spans]}))


def load_trace(path: str | Path) -> list[Span]:
    """Read a traced run: ``{"events": [...]}`` or a bare list of events with rank/kind/microbatch/chunk/
    start/end."""
    data = json.loads(Path(path).read_text())
    events = data["events"] if isinstance(data, dict) else data
    try:
        return [
            Span(
                int(e["rank"]),
                str(e["kind"]),
                int(e["microbatch"]),
                int(e.get("chunk", 0)),
                e["start"],
                e["end"],
            )
            for e in events
        ]
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"{path}: each trace event needs rank, kind, microbatch, (chunk,) start and end; missing {err}"
        ) from err


def bubble_fraction(spans: list[Span]) -> float:
    """Idle over busy time summed over ranks, from the first start to the last end (the simulator's
    definition, so measured and simulated bubbles compare directly)."""
    if not spans:
        return 0.0
    ranks = {s.rank for s in spans}
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    busy = sum(s.end - s.start for s in spans)
    return (len(ranks) * (t1 - t0) - busy) / busy if busy else 0.0


def chrome_trace(spans: list[Span], path: str | Path, microseconds_per_unit: float = 1e6) -> None:
    """Write a Chrome-trace JSON (chrome://tracing, Perfetto): one thread per rank."""
    t0 = min((s.start for s in spans), default=0.0)
    ranks = sorted({s.rank for s in spans})
    events: list[dict] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
        for r in ranks
    ]
    for s in spans:
        events.append(
            {
                "name": f"{s.kind}{s.microbatch}" + (f".{s.chunk}" if s.chunk else ""),
                "cat": s.kind,
                "ph": "X",
                "pid": 0,
                "tid": s.rank,
                "ts": (s.start - t0) * microseconds_per_unit,
                "dur": (s.end - s.start) * microseconds_per_unit,
                "args": {"microbatch": s.microbatch, "chunk": s.chunk},
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Darken ``colour`` for later chunks so the virtual stages of interleaved schedules stand apart."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    factor = 1.0 - 0.45 * chunk / max(chunks - 1, 1)
    return (rgb[0] * factor, rgb[1] * factor, rgb[2] * factor)


def render_png(
    spans: list[Span],
    path: str | Path,
    title: str,
    time_unit: str = "time",
    transfers: list[tuple[int, float, float]] | None = None,
    transfer_label: str = "transfer in flight",
) -> None:
    """Draw spans as a timeline: ranks as rows (rank 0 on top), one coloured block per action, labelled with
    its micro-batch number; ``transfers`` (rank, start, end) as thin red lines under their rank's row,
    ``transfer_label`` in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({s.rank for s in spans})
    chunks = max((s.chunk for s in spans), default=0) + 1
    t0 = min((s.start for s in spans), default=0.0)
    t1 = max((s.end for s in spans), default=1.0)
    width = min(max(8.0, 0.35 * len(spans) / max(len(ranks), 1)), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * len(ranks) + 1.6))
    for s in spans:
        colour = _shade(_COLOURS.get(s.kind, "#888888"), s.chunk, chunks)
        y = ranks.index(s.rank)
        ax.barh(
            y, s.end - s.start, left=s.start - t0, height=0.8, color=colour, edgecolor="black", linewidth=0.4
        )
        # Label only blocks wide enough to hold the number (in axis fraction of the whole step).
        if (s.end - s.start) / (t1 - t0) * width > 0.18:
            ax.text(
                (s.start + s.end) / 2 - t0,
                y,
                str(s.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    for rank, start, end in transfers or []:
        y = ranks.index(rank) + 0.46
        ax.plot([start - t0, end - t0], [y, y], color="#d62728", linewidth=1.2, solid_capstyle="butt")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel(time_unit)
    ax.set_title(title)
    kinds = [k for k in _COLOURS if any(s.kind == k for s in spans)]
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    handles = [Patch(color=_COLOURS[k], label=names[k]) for k in kinds]
    if transfers:
        handles.append(Patch(color="#d62728", label=transfer_label))
    if chunks > 1:
        handles.append(Patch(color="#555555", label=f"darker = later chunk (of {chunks})"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.1 / len(ranks)), ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def show_schedule(
    schedule: str,
    pp: int,
    microbatches: int,
    output: str | Path,
    virtual_stages: int = 1,
    trace: str | Path | None = None,
    chrome_trace_path: str | Path | None = None,
    forward: float = 1.0,
    backward: float = 2.0,
    weight_grad: float | None = None,
    p2p: float = 0.0,
) -> float:
    """Draw ``schedule`` (simulated with per-chunk costs, or the traced run in ``trace``) to a PNG and
    optionally a Chrome trace; returns the bubble fraction shown in the title."""
    sched = build_schedule(schedule, pp, microbatches, virtual_stages)
    v = virtual_stages
    # Costs are given per rank (whole stage) and split evenly over its v chunks.
    sim = simulate(sched, forward / v, backward / v, None if weight_grad is None else weight_grad / v, p2p)
    label = f"{schedule}  pp={pp}  microbatches={microbatches}" + (f"  v={v}" if v > 1 else "")
    if trace is None:
        spans = spans_from_simulation(sim)
        bubble = sim.bubble_fraction
        title = f"{label}  (simulated)  bubble {bubble:.1%}"
        unit, scale = "time (forward of one stage = 1)", 1e3
    else:
        spans = load_trace(trace)
        bubble = bubble_fraction(spans)
        title = (
            f"{label}  (traced)  bubble {bubble:.1%}; simulated {sim.bubble_fraction:.1%} "
            f"(F={forward:g}, B={backward:g}, p2p={p2p:g})"
        )
        unit, scale = "seconds", 1e6
    render_png(spans, output, title, unit)
    if chrome_trace_path is not None:
        chrome_trace(spans, chrome_trace_path, microseconds_per_unit=scale)
    return bubble
