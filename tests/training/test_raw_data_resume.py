"""Training from data.sources (raw JSONL tokenized while training) with the real tools/pretrain.py:
interrupted and resumed, also on another number of data-parallel ranks and of tokenizing workers, and killed
with SIGKILL under torchrun. Reference: the same command run without interruption; the resumed losses equal
it bit for bit (fp32 on CPU, one thread).

Across data-parallel sizes the data are the same bit for bit (tests/data/test_raw_sources.py records every
sample id of 4 -> 2 -> 4 ranks: each global sample once, none skipped, none repeated; here every rank of
every layout of 2 -> 4 -> 2 saves the same data position at the same step). The arithmetic is made the same
too: parallel.dp_reduce=tree sums the gradients in one balanced tree over the global batch's micro-batches
whether 4 ranks hold one each or 2 ranks two (llmtrain.parallel.data_parallel), and the loss is averaged in
float64, where four fp32 losses add exactly. With the backend's all-reduce the losses agree only to fp32
rounding (relative ~1e-7 a step, growing through the updates). Dropout is off in that test: each rank draws
its own masks, so another number of ranks would draw other ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import psutil
import pytest
import torch

from llmtrain.data.tokenizer import train_sentencepiece
from llmtrain.training.metrics_file import latest_per_step, read_rows
from tests.training._runs import ROOT, env, python_command, run_cli, torchrun_command, train_here
from tests.training.test_interrupt import _interrupt

STEPS = 8


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory) -> tuple[str, ...]:
    """Overrides for a JSONL file of stdlib lines and a 512-piece tokenizer trained on them."""
    folder = tmp_path_factory.mktemp("raw")
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]:
        lines += [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tokenizer = train_sentencepiece(lines, folder / "tok.model", 512)
    return (
        f"data.sources=[{folder / 'docs.jsonl'}]",
        f"data.tokenizer={tokenizer}",
        "model.vocab_size=512",
        f"train.steps={STEPS}",
        "logging.interval=1",
        "train.eval_interval=0",
        "model.hidden_dropout=0.1",
    )


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in latest_per_step(read_rows(out)) if "loss" in row}


def _position(out: Path, step: int) -> dict:
    state = torch.load(out / "checkpoints" / f"step_{step}" / "trainer_state.pt", weights_only=False)
    return state["extra"]["data_position"]


@pytest.mark.slow
def test_sigterm_then_resume_with_other_workers_matches_uninterrupted(tmp_path: Path, raw_data) -> None:
    # The reference in this process: the launches under test are the interrupted one and its resume.
    train_here(tmp_path / "reference", *raw_data, "data.num_workers=0")
    run = tmp_path / "run"
    status, stdout, stderr = _interrupt(
        python_command(run, *raw_data, "data.num_workers=2"), signal.SIGTERM, 3
    )
    assert status == 128 + signal.SIGTERM, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    again = run_cli(python_command(run, *raw_data, "data.num_workers=1"), timeout=600)  # 300 s: under load 28
    assert again.returncode == 0, again.stderr
    assert _losses(run) == _losses(tmp_path / "reference")  # bit for bit


def _kill_all_after(command: list[str], out: Path, step: int) -> None:
    """Run `command` (torchrun) with every rank sleeping in step `step` + 2; once the checkpoint of `step`
    is complete and step `step` + 1 logged, SIGKILL torchrun, its ranks and their tokenizing workers at once
    (a node lost), and wait for them to be gone."""
    faults = {**env(), "LLMTRAIN_FAULTS": f"slow_rank:step={step + 2}:seconds=120"}
    proc = subprocess.Popen(command, cwd=ROOT, env=faults, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() == f"step_{step}" and step + 1 in _losses(out):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    victims = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    psutil.wait_procs([psutil.Process(p) for p in victims if psutil.pid_exists(p)], timeout=30)


@pytest.mark.slow
def test_two_then_four_killed_then_two_ranks_repeat_the_losses(tmp_path: Path, raw_data) -> None:
    """Global batch 8 of micro-batches of 2: 2 ranks of two micro-batches, then 4 of one (killed), then 2
    again. Both directions of the change, as 4 -> 2 -> 4 had, with two rank processes fewer to start."""
    common = (*raw_data, "model.hidden_dropout=0.0", "checkpoint.interval=2", "checkpoint.keep=10")
    common += ("train.micro_batch_size=2", "parallel.dp_reduce=tree")
    two, four, back = tmp_path / "two", tmp_path / "four", tmp_path / "back"
    result = run_cli(torchrun_command(2, two, *common, "parallel.dp=2"))
    assert result.returncode == 0, result.stderr
    load = f"checkpoint.load={two / 'checkpoints' / 'step_2'}"
    _kill_all_after(torchrun_command(4, four, *common, "parallel.dp=4", "data.num_workers=2", load), four, 4)
    load = f"checkpoint.load={four / 'checkpoints' / 'step_4'}"
    result = run_cli(torchrun_command(2, back, *common, "parallel.dp=2", "data.num_workers=1", load))
    assert result.returncode == 0, result.stderr
    reference, grown, shrunk = _losses(two), _losses(four), _losses(back)
    assert sorted(grown) == [3, 4, 5] and sorted(shrunk) == list(range(5, STEPS + 1))
    for step in (4,):  # the position is a function of the step alone, whatever the layout
        assert _position(four, step) == _position(two, step)
    assert _position(back, 8) == _position(two, 8)
    # Bit for bit: 4 ranks of one micro-batch after 2 of two, 2 again after 4, and the step 5 that the
    # killed launch logged is redone identically.
    assert grown == {s: reference[s] for s in grown}
    assert shrunk == {s: reference[s] for s in shrunk}
    assert min(abs(reference[s + 1] - reference[s]) for s in range(1, STEPS)) > 1e-3 * reference[1]
