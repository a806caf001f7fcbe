"""StepTimer against a clock the test advances; ProfilerWindow traces exactly the requested steps."""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain.training.profiling import ProfilerWindow, StepTimer


def test_step_timer_accumulates_sections_per_step():
    # A clock the test advances: wall-clock bounds on sleeps fail on a loaded machine.
    now = [0.0]
    timer = StepTimer(enabled=True, synchronize=False, clock=lambda: now[0])
    for _ in range(2):  # two micro-batches, with untimed work between the sections
        with timer.section("forward"):
            now[0] += 0.02
        now[0] += 1.0
        with timer.section("backward"):
            now[0] += 0.04
        now[0] += 1.0
    timer.add("dp_comm", 0.5)
    totals = timer.pop()
    assert set(totals) == {"forward", "backward", "dp_comm"}
    assert totals["forward"] == pytest.approx(0.04)
    assert totals["backward"] == pytest.approx(0.08)
    assert totals["dp_comm"] == 0.5
    assert timer.pop() == {}  # pop resets


def test_step_timer_disabled_records_nothing_and_still_runs_the_body():
    timer = StepTimer(enabled=False)
    ran = []
    with timer.section("forward"):
        ran.append(1)
    timer.add("dp_comm", 1.0)
    assert ran == [1] and timer.pop() == {}


def test_profiler_window_traces_only_the_window(tmp_path):
    window = ProfilerWindow([2, 3], tmp_path, rank=1)
    a = torch.randn(64, 64)
    for step in range(1, 5):
        with window.step(step):
            torch.mm(a, a) if step in (2, 3) else torch.add(a, a)
    assert window.trace_path == tmp_path / "profile" / "rank1_steps2-3.json"
    events = json.loads(window.trace_path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3", "aten::mm"} <= names
    assert "step 1" not in names and "step 4" not in names and "aten::add" not in names
    assert "aten::mm" in (tmp_path / "profile" / "rank1_steps2-3.txt").read_text()


def test_profiler_window_closes_a_window_the_run_ends_inside(tmp_path):
    window = ProfilerWindow([2, 10], tmp_path)
    for step in range(1, 4):
        with window.step(step):
            torch.ones(4).sum()
    assert window.trace_path is None
    window.close()
    assert window.trace_path is not None and window.trace_path.exists()


def test_profiler_window_rejects_bad_steps(tmp_path):
    with pytest.raises(ValueError, match="logging.profile_steps"):
        ProfilerWindow([5, 2], tmp_path)
