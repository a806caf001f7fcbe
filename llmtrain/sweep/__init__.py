"""Config sweeps: run every combination of overrides as its own training job, then tabulate and plot."""

from llmtrain.sweep.grid import SweepPoint, load_list, parse_grid
from llmtrain.sweep.runner import RunResult, run_sweep
from llmtrain.sweep.summary import summarize

__all__ = ["RunResult", "SweepPoint", "load_list", "parse_grid", "run_sweep", "summarize"]
