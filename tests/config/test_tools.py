"""The config and sweep tools start fast (the library is imported inside main) and print user errors as one
line, with the traceback only under --debug."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ["sweep.py", "show_schedule.py", "gen_config_reference.py"]
HEAVY = ["torch", "numpy", "matplotlib", "yaml", "llmtrain.config", "llmtrain.sweep", "llmtrain.pipeline"]

_IMPORTED = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tool", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(" ".join(name for name in sys.argv[2:] if name in sys.modules))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("tool", TOOLS)
def test_importing_a_tool_loads_no_library(tool):
    result = _python("-c", _IMPORTED, str(ROOT / "tools" / tool), *HEAVY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []  # --help is answered from argparse alone


@pytest.mark.parametrize("tool", TOOLS)
def test_help_lists_the_debug_flag(tool):
    result = _python(str(ROOT / "tools" / tool), "--help")
    assert result.returncode == 0 and "--debug" in result.stdout, result.stderr


def test_show_schedule_errors_are_one_line(tmp_path):
    tool = str(ROOT / "tools" / "show_schedule.py")
    args = [
        tool,
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--output",
        str(tmp_path / "s.png"),
    ]
    bad_trace = tmp_path / "trace.json"
    bad_trace.write_text("{")
    result = _python(*args, "--trace", str(bad_trace))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"show_schedule: error: --trace {bad_trace} is not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    ]
    result = _python(*args[:-2], "--virtual-stages", "2", "--output", str(tmp_path / "s.png"))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("show_schedule: error: parallel.virtual_stages=2 needs")
    debug = _python(*args, "--trace", str(bad_trace), "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    negative = _python(*args, "--forward", "-1")
    assert (
        negative.returncode == 2 and "argument --forward: must be a number >= 0; got '-1'" in negative.stderr
    )
    assert not (tmp_path / "s.png").exists()
