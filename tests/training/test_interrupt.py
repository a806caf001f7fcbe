"""SIGINT / SIGTERM against the real tools/pretrain.py: the step finishes, a checkpoint is saved and named,
the exit status is 130 / 143 with no traceback, and rerunning the same command resumes at the next step.

Reference: the same command run without interruption. The concatenated loss curve (the latest row per step
of metrics.jsonl, as every reader takes it) must equal it bit for bit: fp32 on CPU, one thread, with
dropout on so that the RNG states are part of what the checkpoint must carry.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmtrain.training.metrics_file import latest_per_step, read_rows
from tests.training._runs import ROOT, env, python_command, run_cli, torchrun_command, train_here

STEPS = 40
COMMON = (
    f"train.steps={STEPS}",
    "logging.interval=1",
    "train.eval_interval=0",
    "model.hidden_dropout=0.1",
)
PROGRESS = re.compile(r"^step\s+(\d+)/")


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in latest_per_step(read_rows(out)) if "loss" in row}


def _interrupt(command: list[str], sig: signal.Signals, after_step: int) -> tuple[int, str, str]:
    """Start `command`, send `sig` once its progress shows `after_step`; return (status, stdout, stderr).

    The signal goes to the command's whole process group, as a terminal's Ctrl-C does (DataLoader
    workers included); torchrun's workers live in sessions of their own and get it from torchrun.
    """
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env(),
        start_new_session=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        match = PROGRESS.match(line)
        if match and int(match.group(1)) >= after_step:
            os.killpg(proc.pid, sig)
            break
    rest, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + rest, err


def _check_stopped(out: Path, sig: signal.Signals, status: int, stdout: str, stderr: str) -> int:
    """The interrupted launch's promises; returns the step it stopped at."""
    assert status == 128 + sig, (status, stdout, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    assert stderr.count(f"{sig.name} received: finishing this step, then saving a checkpoint") == 1, stderr
    match = re.search(rf"stopped by {sig.name} at step (\d+)/{STEPS} .*; checkpoint (\S+); rerun", stdout)
    assert match, stdout
    stopped = int(match.group(1))
    assert 0 < stopped < STEPS, "the signal must land mid-run (the test needs a slower step otherwise)"
    checkpoint = out / "checkpoints" / f"step_{stopped}"
    assert match.group(2) == str(checkpoint)
    assert f"checkpoint saved: {checkpoint} in " in stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"
    assert (checkpoint / "manifest.json").is_file()
    assert max(_losses(out)) == stopped  # the partial logging window was written too
    return stopped


def _check_resumed(out: Path, stopped: int, stdout: str, launches: int = 2) -> None:
    """The launch that printed `stdout` resumed where the one before stopped; `launches` in the run."""
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped}'} at step {stopped}" in stdout
    first_step = next(int(m.group(1)) for line in stdout.splitlines() if (m := PROGRESS.match(line)))
    assert first_step == stopped + 1
    assert {row["segment"] for row in read_rows(out)} == set(range(launches))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The loss curve of the command run without interruption, with data.num_workers=0: every case runs
    the same command, so they share one reference run, in this process (what a launch adds is what the
    interrupted runs check). The launches with a DataLoader worker compare against it too: batches are a
    pure function of the step and the loader has a private generator, so a worker changes no loss (a loader
    that drew its seed from the global RNG would shift dropout and show here, where a reference of its own
    with a worker would have shifted alike)."""
    out = tmp_path_factory.mktemp("reference")
    train_here(out, *COMMON, "data.num_workers=0")
    curve = _losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


# SIGINT and SIGTERM share one run: the launch resumed after the SIGINT stop is the launch SIGTERM stops
# (each stop and each resume is checked as it was alone, and a stop in a resumed launch must save and
# resume exactly too). The SIGTERM launch has a DataLoader worker, the launches before and after it none:
# the signal reaches the whole process group (as Slurm's does) and the worker must outlive it, and a loader
# with a worker resumed from a run without one (and the reverse) must not shift the data or the dropout
# stream. One run of four launches (the reference in this process) instead of a run per signal, each of
# which starts torch for every launch.
LAUNCHES = ((signal.SIGINT, 0), (signal.SIGTERM, 1), (None, 0))
"""(signal, data.num_workers) of each launch of the run: None runs to the end."""


@pytest.mark.slow
def test_signal_saves_exits_and_resume_matches_uninterrupted_run(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    out = tmp_path / "run"
    stopped = 0
    for launch, (sig, workers) in enumerate(LAUNCHES):
        command = python_command(out, *COMMON, f"data.num_workers={workers}")
        if sig is None:
            done = run_cli(command, timeout=600)  # 40 steps took 300 s on two cores under load 28
            assert done.returncode == 0, done.stderr
            stdout = done.stdout
        else:
            status, stdout, stderr = _interrupt(command, sig, after_step=stopped + 3)
        if launch:
            _check_resumed(out, stopped, stdout, launches=launch + 1)
        if sig is not None:
            stopped = _check_stopped(out, sig, status, stdout, stderr)
    assert _losses(out) == uninterrupted  # bit for bit


@pytest.mark.slow
def test_sigint_to_torchrun_saves_on_every_rank_and_resume_matches(tmp_path: Path) -> None:
    """Ctrl-C reaches torchrun, which forwards SIGINT to its workers (each in its own session); the ranks
    agree on the stop in the step's all-reduce, save one checkpoint together and exit 130."""
    common = (*COMMON, "parallel.dp=2", "train.micro_batch_size=2")
    reference = run_cli(torchrun_command(2, tmp_path / "reference", *common))
    assert reference.returncode == 0, reference.stderr
    status, stdout, stderr = _interrupt(torchrun_command(2, tmp_path / "run", *common), signal.SIGINT, 3)
    # torchrun itself ends with its own status and log lines on a signal; the workers' promises hold.
    assert status != 0
    match = re.search(rf"stopped by SIGINT at step (\d+)/{STEPS} ", stdout)
    assert match, (stdout, stderr)
    stopped = int(match.group(1))
    assert 0 < stopped < STEPS
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{stopped}"
    assert stdout.count(f"checkpoint saved: {checkpoint} in ") == 1  # rank 0 only
    assert sorted(p.name for p in (checkpoint / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert "Traceback" not in stdout and "[rank" not in stderr, stderr  # no worker traceback
    again = run_cli(torchrun_command(2, tmp_path / "run", *common))
    assert again.returncode == 0, again.stderr
    _check_resumed(tmp_path / "run", stopped, again.stdout)
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")


def test_second_sigint_exits_at_once_and_repeated_sigterm_is_ignored(tmp_path: Path) -> None:
    """StopRequest in a process of its own: the first signal is recorded, a repeated SIGTERM changes
    nothing, a second SIGINT ends the process at once with 130."""
    script = textwrap.dedent(
        """
        import os, signal
        from llmtrain.training.interrupt import StopRequest
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            print("after SIGTERM x2:", stop.signum, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            print("after SIGINT:", stop.signum, flush=True)
        with StopRequest() as stop:
            child = os.fork()  # as a DataLoader worker is: it inherits the handler and leaves it alone
            if child == 0:
                os.kill(os.getpid(), signal.SIGINT)
                print("forked child after SIGINT:", stop.signum, flush=True)
                os._exit(0)
            os.waitpid(child, 0)
            os.kill(os.getpid(), signal.SIGINT)
            print("first SIGINT:", stop.signum, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            print("not reached", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == [
        f"after SIGTERM x2: {int(signal.SIGTERM)}",
        f"after SIGINT: {int(signal.SIGTERM)}",
        "forked child after SIGINT: 0",
        f"first SIGINT: {int(signal.SIGINT)}",
    ]
    assert done.stderr.splitlines() == [
        "SIGTERM received: finishing this step, then saving a checkpoint",
        "SIGINT received: finishing this step, then saving a checkpoint (Ctrl-C again to exit at once "
        "without saving)",
        "SIGINT again: exiting now without saving; the last complete checkpoint is kept",
    ]
    assert "Traceback" not in done.stderr


def test_handlers_are_restored_after_training(tmp_path: Path) -> None:
    from llmtrain.training.interrupt import StopRequest

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest():
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before
