"""StepTimer against sleeps of known length; ProfilerWindow traces exactly the requested steps."""

from __future__ import annotations

import json
import time

import pytest
import torch

from llmtrain.training.profiling import ProfilerWindow, StepTimer


def test_step_timer_accumulates_sections_per_step():
    timer = StepTimer(enabled=True, synchronize=False)
    for _ in range(2):  # two micro-batches
        with timer.section("forward"):
            time.sleep(0.02)
        with timer.section("backward"):
            time.sleep(0.04)
    timer.add("dp_comm", 0.5)
    totals = timer.pop()
    assert set(totals) == {"forward", "backward", "dp_comm"}
    assert 0.04 <= totals["forward"] < 0.04 + 0.05  # sleep never returns early; slack for a loaded machine
    assert 0.08 <= totals["backward"] < 0.08 + 0.05
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
