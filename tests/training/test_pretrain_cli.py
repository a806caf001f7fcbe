"""tools/pretrain.py as users meet it: a fast --help, one-line errors (tracebacks on request), a config error
printed once under torchrun, and the final line of a rerun with nothing to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_time import run_counting_cpu
from tests.training._runs import CONFIG, PRETRAIN, ROOT, python_command, run_cli

TP3_ERROR = (
    "pretrain: error: parallel.tp=3 does not divide model.num_attention_heads=8; "
    "choose a tp among its divisors"
)


def test_help_answers_in_under_a_second_without_importing_torch() -> None:
    done, cpu_s = run_counting_cpu(
        [sys.executable, str(PRETRAIN), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0 and "--config" in done.stdout and "--debug" in done.stdout
    assert cpu_s < 1.0, f"--help took {cpu_s:.2f} CPU seconds"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy, sys; sys.argv = ['pretrain.py', '--help']\n"
            f"try: runpy.run_path({str(PRETRAIN)!r}, run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert probe.stdout.splitlines()[-1] == "no torch"


def test_config_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    out = tmp_path / "never"
    done = run_cli(
        [sys.executable, str(PRETRAIN), "--config", str(CONFIG), "parallel.tp=3", f"output_dir={out}"]
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", TP3_ERROR + "\n")
    missing = run_cli([sys.executable, str(PRETRAIN), "--config", str(tmp_path / "nope.yaml")])
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1
    assert "nope.yaml does not exist" in missing.stderr
    debug = run_cli(
        [
            sys.executable,
            str(PRETRAIN),
            "--config",
            str(CONFIG),
            "parallel.tp=3",
            f"output_dir={out}",
            "--debug",
        ]
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr
    assert not out.exists()


@pytest.mark.slow
def test_nothing_to_do_exits_0_with_both_numbers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_cli(python_command(out, "train.steps=2", "train.eval_interval=0"))
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1].startswith("done: step 2/2 (2 steps in ")
    again = run_cli(python_command(out, "train.steps=2", "train.eval_interval=0"))
    assert (again.returncode, again.stderr) == (0, "")
    assert again.stdout == (
        f"{out} is at step 2 of train.steps=2: nothing to do; raise train.steps (e.g. train.steps=4) "
        "to continue, or choose a new output_dir\n"
    )


@pytest.mark.slow
def test_config_error_under_torchrun_is_printed_once(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = run_cli(
        [*command, str(PRETRAIN), "--config", str(CONFIG), "parallel.tp=3", f"output_dir={tmp_path}/never"]
    )
    assert done.returncode != 0
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "pretrain: error:" in line]
    assert ours == [TP3_ERROR]
    # No worker traceback; what follows is torchrun's own report of a failed job (rank 0 as the root cause).
    assert "[rank" not in done.stderr and "ConfigError" not in done.stderr
    assert "exitcode  : 2" in done.stderr
    assert not (tmp_path / "never").exists()
