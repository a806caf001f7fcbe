"""tools/pretrain.py as users meet it: a fast --help, one-line errors (tracebacks on request), a config error
printed once under torchrun, and the final line of a rerun with nothing to do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.imports import run_listing_imports, third_party
from tests.training._runs import CONFIG, PRETRAIN, ROOT, python_command, run_cli

TP3_ERROR = (
    "pretrain: error: parallel.tp=3 does not divide model.num_attention_heads=8; "
    "choose a tp among its divisors"
)


def test_help_answers_at_once_without_importing_torch() -> None:
    done, imported = run_listing_imports([str(PRETRAIN), "--help"], ROOT)
    assert done.returncode == 0 and "--config" in done.stdout and "--debug" in done.stdout
    # Only the standard library and llmtrain's light modules: no torch, numpy or yaml to wait for.
    assert not third_party(imported), f"--help imported {sorted(third_party(imported))}"
    assert "torch" not in imported


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
