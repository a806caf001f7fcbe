"""Bad steps and stragglers, injected through LLMTRAIN_FAULTS (llmtrain.faults).

A NaN loss, an inf gradient or a loss spike skips the update on every rank: the reference for "skipped" is
the weights and Adam's step count before the step, which must come out bit for bit unchanged, while the
good steps around it must change them. train.max_bad_steps skips in a row stop the run with exit 3 and the
last good checkpoint, which the same command then resumes. A rank made slow is named in the progress line.
"""

from __future__ import annotations

import io
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from llmtrain.config import load
from llmtrain.faults import ENV
from llmtrain.parallel import Topology
from llmtrain.parallel.watchdog import Watchdog
from llmtrain.training.metrics_file import latest_per_step, read_rows
from llmtrain.training.run import build_trainer
from tests.parallel._dist import spawn
from tests.training._runs import CONFIG, ROOT, TINY, env, python_command, train_here

# On one process: a NaN loss, an inf gradient, a spike of the loss.
FAULTS = "nan_loss:step=2,inf_grad:step=3,loss_spike:step=5:factor=5"
# On four: the NaN loss on rank 0 only (a first pipeline stage, whose loss the last one broadcast), the inf
# gradient on rank 1 only, after the gradient reduction (the ranks of the other replica never see it in
# their norm: only the step's agreement makes them skip), the spike on every rank.
FAULTS_ON_RANKS = "nan_loss:step=2:rank=0,inf_grad:step=3:rank=1,loss_spike:step=5:factor=5"
SKIPPED = {2: "nan loss", 3: "inf grad", 5: "loss spike 5.0x the mean of the last 1 good steps"}
STEPS = 6
# A window of one good step, so the spike check is on from step 2; the interval puts the run's only
# regular row at the end: every other row is a skipped step's own.
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.loss_spike_window=1",
    "train.eval_interval=0",
    "logging.interval=100",
]


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _Snapshots:
    """Wraps a step runner: this rank's parameters as each step begins, i.e. after the previous update."""

    def __init__(self, runner, model: torch.nn.Module) -> None:
        self.runner, self.model, self.taken = runner, model, []

    def train_step(self, batch, timer):
        self.taken.append(_params(self.model))
        return self.runner.train_step(batch, timer)

    def eval_step(self, batch):
        return self.runner.eval_step(batch)


def _fit_with_snapshots(job, topo: Topology) -> dict:
    """Train `job`; every rank's parameters before each step and after the last, its skips and its output."""
    trainer = build_trainer(job, topo)
    console = io.StringIO()
    trainer.metrics.stream = console
    trainer.runner = _Snapshots(trainer.runner, trainer.model)
    try:
        result = trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.checkpointer.close()
    adam_steps = {int(state["step"]) for state in trainer.optimizer.optimizer.state.values()}
    return {
        "params": [*trainer.runner.taken, _params(trainer.model)],
        "skipped": result.skipped_steps,
        "adam_steps": adam_steps,
        "coords": (topo.coords["pp"], topo.coords["dp"]),
        "console": console.getvalue(),
    }


def _assert_only_the_bad_steps_left_the_weights(params: list[list[torch.Tensor]]) -> None:
    """params[k] are the weights after step k (params[0]: before step 1)."""
    for step in range(1, STEPS + 1):
        unchanged = all(torch.equal(a, b) for a, b in zip(params[step - 1], params[step], strict=True))
        assert unchanged == (step in SKIPPED), f"step {step}: weights {'un' if unchanged else ''}changed"


def _assert_rows_name_the_skips(out: Path) -> None:
    rows = [r for r in latest_per_step(read_rows(out)) if "eval_loss" not in r]
    assert [r["step"] for r in rows] == [*SKIPPED, STEPS]
    assert [r["skip_reason"] for r in rows] == [*SKIPPED.values(), None]
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3, 3]
    assert rows[0]["loss"] is None and rows[1]["grad_norm"] is None  # NaN and inf are written as null
    assert rows[2]["loss"] > 4 * rows[3]["loss"]  # the spike row keeps the spiking loss


@pytest.mark.slow
def test_bad_steps_are_skipped_logged_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, FAULTS)
    job = load(str(CONFIG), [*TINY, *OVERRIDES, f"output_dir={tmp_path}"])
    run = _fit_with_snapshots(job, Topology.single())
    _assert_only_the_bad_steps_left_the_weights(run["params"])
    assert run["skipped"] == 3 and run["adam_steps"] == {STEPS - 3}  # Adam's moments skipped the steps too
    _assert_rows_name_the_skips(tmp_path)
    lines = run["console"].splitlines()
    for step, reason in SKIPPED.items():
        assert any(line.startswith(f"step {step}/") and f"(this step: {reason})" in line for line in lines)


def _pipeline_worker(rank: int, world: int, out: str) -> dict:
    os.environ[ENV] = FAULTS_ON_RANKS
    torch.set_num_threads(1)
    job = load(str(CONFIG), [*TINY, *OVERRIDES, "parallel.pp=2", "parallel.dp=2", f"output_dir={out}"])
    return _fit_with_snapshots(job, Topology(job.parallel, world, rank))


@pytest.mark.slow
def test_every_rank_skips_the_same_steps_under_pp_and_dp(tmp_path: Path) -> None:
    runs = spawn(4, _pipeline_worker, str(tmp_path))
    for rank, run in enumerate(runs):
        assert run["skipped"] == 3, f"rank {rank}"
        assert run["adam_steps"] == {STEPS - 3}, f"rank {rank}"
        _assert_only_the_bad_steps_left_the_weights(run["params"])
    # The two data-parallel replicas of each stage end bit for bit equal: no replica stepped alone.
    by_coords = {run["coords"]: run["params"][-1] for run in runs}
    for stage in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(by_coords[stage, 0], by_coords[stage, 1], strict=True))
    _assert_rows_name_the_skips(tmp_path)


@pytest.mark.slow
def test_bad_steps_in_a_row_stop_with_exit_3_and_the_last_good_checkpoint_resumes(tmp_path: Path) -> None:
    overrides = ("train.steps=8", "checkpoint.interval=4", "train.max_bad_steps=2", "train.eval_interval=0")
    command = python_command(tmp_path, *overrides)
    faulty = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env(), ENV: "nan_loss:step=5,inf_grad:step=6"},
        timeout=300,
    )
    assert faulty.returncode == 3, faulty.stderr
    kept = tmp_path / "checkpoints" / "step_4"
    assert faulty.stderr.strip().splitlines() == [
        "pretrain: error: 2 steps in a row were skipped (the last at step 6: inf grad); stopping, the last "
        f"good checkpoint {kept} is kept. Lower train.lr, or raise train.max_bad_steps (or "
        "train.loss_spike_factor for spikes), and rerun the same command to resume."
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_4"]

    # The same job again, without the faults, resumes. It runs in this process (train_here: the job of
    # `command`, through llmtrain.training.run as tools/pretrain.py runs it): the launch above already showed
    # the command line's side (exit 3, the message); a second process would only start torch again (~8 CPU-s).
    train_here(tmp_path, *overrides)
    rows = [r for r in read_rows(tmp_path) if "eval_loss" not in r]
    assert [(r["segment"], r["step"], r["skip_reason"]) for r in rows] == [
        (0, 5, "nan loss"),
        (0, 6, "inf grad"),
        (1, 8, None),
    ]
    assert rows[-1]["skipped_steps"] == 0  # the resumed run counts from its checkpoint, before the skips
    assert (tmp_path / "checkpoints" / "step_8").is_dir()


def _straggler_worker(rank: int, world: int, out: str) -> str:
    os.environ[ENV] = "slow_rank:rank=1:seconds=0.3"
    torch.set_num_threads(1)
    job = load(
        str(CONFIG),
        [*TINY, "train.steps=4", "logging.interval=2", "train.eval_interval=0", f"output_dir={out}"],
    )
    trainer = build_trainer(job, Topology(job.parallel, world, rank))
    trainer.metrics.stream = console = io.StringIO()
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.checkpointer.close()
    return console.getvalue()


@pytest.mark.slow
def test_a_slow_rank_is_named_in_the_progress_line(tmp_path: Path) -> None:
    console = spawn(2, _straggler_worker, str(tmp_path))[0]
    progress = [line for line in console.splitlines() if line.startswith("step ")]
    assert len(progress) == 2 and all("slow rank 1 (" in line for line in progress), console
    assert not any("slow rank 0" in line for line in progress)
    for row in read_rows(tmp_path):
        # Rank 1 sleeps 0.3 s per step before its forward; rank 0's own compute does not wait for it.
        assert row["slowest_rank"] == 1 and row["rank_step_time_max_s"] >= 0.3
        assert set(row["slow_ranks"]) == {"1"} and row["rank_step_time_min_s"] < row["rank_step_time_max_s"]


@pytest.mark.slow
def test_fp16_overflows_halve_the_loss_scale_without_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Overflows are how dynamic loss scaling finds its scale: they never count toward train.max_bad_steps.
    monkeypatch.setenv(ENV, "inf_grad:step=2,inf_grad:step=3")
    overrides = ["train.steps=4", "train.precision=fp16", "train.max_bad_steps=2", "logging.interval=1"]
    job = load(str(CONFIG), [*TINY, *overrides, "train.eval_interval=0", f"output_dir={tmp_path}"])
    run = _fit_with_snapshots(job, Topology.single())
    assert run["skipped"] == 2 and run["adam_steps"] == {2}
    rows = latest_per_step(read_rows(tmp_path))
    assert [r["loss_scale"] for r in rows] == [65536, 65536, 32768, 16384]
    assert [r["skip_reason"] for r in rows] == [
        None,
        "inf grad: fp16 overflow at loss scale 65536",
        "inf grad: fp16 overflow at loss scale 32768",
        None,
    ]


class _StalledBatches:
    """The job's data, with the first batch arriving only after `seconds`."""

    def __init__(self, data, seconds: float) -> None:
        self.data, self.seconds = data, seconds

    def train_batches(self, consumed_samples: int, position: dict | None = None):
        time.sleep(self.seconds)
        yield from self.data.train_batches(consumed_samples, position)

    def position(self, consumed_samples: int) -> dict | None:
        return self.data.position(consumed_samples)


@pytest.mark.slow
def test_the_watchdog_sees_a_stalled_data_loader(tmp_path: Path) -> None:
    job = load(str(CONFIG), [*TINY, "train.steps=1", "train.eval_interval=0", f"output_dir={tmp_path}"])
    trainer = build_trainer(job, Topology.single())
    reports: list[str] = []
    trainer.topo.watchdog = Watchdog(0.2, on_hang=reports.append, poll_s=0.05).start()
    trainer.data = _StalledBatches(trainer.data, seconds=1.0)
    try:
        trainer.fit()
    finally:
        trainer.topo.watchdog.stop()
        trainer.metrics.close()
        trainer.checkpointer.close()
    assert len(reports) == 1 and "data-loader fetch on group 'local' (step 1)" in reports[0], reports
