"""Where a step's time goes: named section timers and a torch.profiler window over chosen steps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


class StepTimer:
    """Accumulates wall time per named section (forward, backward, optimizer, pp_wait, dp_comm, ...).

    A section may be entered many times per step (once per micro-batch); `pop()` returns the totals
    since the last pop. Sections are meant to be disjoint: a nested section's time is also counted
    in its parent. Disabled, every call is a no-op, so the trainer can leave the calls in place.
    """

    def __init__(
        self, enabled: bool, synchronize: bool | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.enabled = enabled
        self.clock = clock
        # CUDA work is asynchronous: without a sync at each boundary the time lands in whichever
        # section happens to block next. The syncs cost throughput, hence logging.time_breakdown.
        self.synchronize = torch.cuda.is_available() if synchronize is None else synchronize
        self._totals: dict[str, float] = {}

    def _sync(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the body under `name`."""
        if not self.enabled:
            yield
            return
        self._sync()
        start = self.clock()
        try:
            yield
        finally:
            self._sync()
            self.add(name, self.clock() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. by a communication hook) to `name`."""
        if self.enabled:
            self._totals[name] = self._totals.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """Seconds per section since the last pop (empty when disabled); pass as values['breakdown']."""
        totals, self._totals = self._totals, {}
        return totals


class ProfilerWindow:
    """torch.profiler over steps [first, last] (1-based, inclusive), traced on every rank.

    The trainer wraps each iteration: `with window.step(step): ...`. Steps outside the window cost
    nothing. The Chrome trace goes to <output_dir>/profile/rank<R>_steps<first>-<last>.json (open in
    Perfetto or chrome://tracing) with a top-operators table beside it.
    """

    def __init__(self, profile_steps: list[int], output_dir: str | Path, rank: int = 0) -> None:
        if profile_steps and (len(profile_steps) != 2 or not 1 <= profile_steps[0] <= profile_steps[1]):
            raise ValueError(
                f"logging.profile_steps must be [first, last] with 1 <= first <= last; got {profile_steps}"
            )
        self.window = tuple(profile_steps) if profile_steps else None
        self.directory = Path(output_dir) / "profile"
        self.rank = rank
        self.trace_path: Path | None = None  # set once the trace is written
        self._profiler: Any = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one training step (numbered as the step being run), profiling it if in the window."""
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            yield
            return
        if self._profiler is None:
            # Started at the first step inside the window: a run resumed mid-window still traces.
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=True
            )
            self._profiler.__enter__()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if step == self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop an open trace and write it (the run may end before the window does)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}_steps{self.window[0]}-{self.window[1]}"
        self.trace_path = self.directory / f"{stem}.json"
        profiler.export_chrome_trace(str(self.trace_path))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=30)
        (self.directory / f"{stem}.txt").write_text(table + "\n")
