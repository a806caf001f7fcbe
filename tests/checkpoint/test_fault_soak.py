"""benchmarks/fault_soak.py's record of a soak: restarts, steps lost per restart, data lost, from the rows
each launch appended to metrics.jsonl (hand-written here, so every figure is known in advance)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fault_soak.py"


def _load():
    spec = importlib.util.spec_from_file_location("fault_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # The script's dataclass looks its module up by name while it is being defined.
    sys.modules["fault_soak"] = module
    spec.loader.exec_module(module)
    return module


fault_soak = _load()


def _rows(segment: int, steps: range, loss=lambda step: 10.0 - step) -> list[dict]:
    return [{"step": step, "segment": segment, "loss": loss(step)} for step in steps]


REFERENCE = _rows(0, range(1, 9))


def test_steps_lost_counted_per_restart() -> None:
    # Checkpoints every 2 steps. Launch 0 logs 1-3 and dies; launch 1 resumes at 2 and logs 3-5 (redoes 3);
    # launch 2 resumes at 4 and logs 5-6 (redoes 5); launch 3 resumes at 4 and logs 5-8 (redoes 5 and 6).
    # An eval row is no step.
    soak = (
        _rows(0, range(1, 4))
        + _rows(1, range(3, 6))
        + [{"step": 4, "segment": 1, "eval_loss": 1.0}]
        + _rows(2, range(5, 7))
        + _rows(3, range(5, 9))
    )
    result = fault_soak.compare(REFERENCE, soak, steps=8)
    assert result.restarts == 3
    assert result.steps_lost == [1, 1, 2]
    assert result.rerun_differ == 0
    assert result.missing == [] and result.differ == []
    assert result.final_loss == result.reference_loss == 2.0


def test_a_restart_that_redoes_nothing_counts_zero() -> None:
    # Killed right after the step-4 checkpoint: the next launch starts at step 5, nothing redone.
    soak = _rows(0, range(1, 5)) + _rows(1, range(5, 9))
    result = fault_soak.compare(REFERENCE, soak, steps=8)
    assert (result.restarts, result.steps_lost) == (1, [0])


def test_lost_and_changed_data_are_reported() -> None:
    # The restart redoes step 3 with another loss than launch 0 and the reference logged, and stops at 7.
    soak = _rows(0, range(1, 4)) + _rows(1, range(3, 8), loss=lambda step: 10.0 - step + (step == 3))
    result = fault_soak.compare(REFERENCE, soak, steps=8)
    assert result.rerun_differ == 1
    assert result.missing == [8]
    assert result.differ == [3]
    assert result.final_loss is None


def test_resumed_launches_read_from_the_launch_log(tmp_path: Path) -> None:
    launches = [
        {"segment": 0, "start_step": 0, "resumed_from": None},
        {"segment": 1, "start_step": 0, "resumed_from": None},  # killed before the first checkpoint
        {"segment": 2, "start_step": 2, "resumed_from": "checkpoints/step_2"},
    ]
    (tmp_path / "launches.jsonl").write_text("".join(json.dumps(launch) + "\n" for launch in launches))
    assert fault_soak.resumed_launches(tmp_path) == 1
    assert fault_soak.resumed_launches(tmp_path / "missing") == 0


@pytest.mark.slow
def test_one_kill_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two workers, one kill: the whole path (reference, kill, restart, record) passes and prints its row.
    argv = ["--kills", "1", "--steps", "3", "--nproc", "2", "--layout", "parallel.tp=2"]
    code = fault_soak.main([*argv, "--no-busy", "--output", str(tmp_path), "--timeout", "600"])
    printed = capsys.readouterr().out
    assert code == 0, printed + (tmp_path / "soak.log").read_text()[-3000:]
    assert "| parallel.tp=2 | 1 | 1 (" in printed and printed.rstrip().endswith("PASS")
