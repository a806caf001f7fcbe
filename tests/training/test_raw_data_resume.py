"""Training from data.sources (raw JSONL tokenized while training) with the real tools/pretrain.py:
interrupted and resumed, also on another number of data-parallel ranks and of tokenizing workers.

Reference: the same command run without interruption. On one layout the resumed loss curve equals it bit
for bit (fp32 on CPU, one thread, dropout on). Across layouts the data are the same bit for bit
(tests/data/test_raw_sources.py proves the global batches equal; here every rank of every layout saves the
same data position at the same step), while the arithmetic is not: 2 ranks accumulate two micro-batches
where 4 ranks all-reduce four, and each rank draws its own dropout masks (off in that test), so a loss
agrees only to fp32 rounding of the reductions (relative 1e-5, far below the step-to-step change of the loss).
"""

from __future__ import annotations

import json
import signal
import sysconfig
from pathlib import Path

import pytest
import torch

from llmtrain.data.tokenizer import train_sentencepiece
from llmtrain.training.metrics_file import latest_per_step, read_rows
from tests.training._runs import python_command, run_cli, torchrun_command
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
    reference = run_cli(python_command(tmp_path / "reference", *raw_data, "data.num_workers=0"))
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    status, stdout, stderr = _interrupt(
        python_command(run, *raw_data, "data.num_workers=2"), signal.SIGTERM, 3
    )
    assert status == 128 + signal.SIGTERM, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    again = run_cli(python_command(run, *raw_data, "data.num_workers=1"))
    assert again.returncode == 0, again.stderr
    assert _losses(run) == _losses(tmp_path / "reference")  # bit for bit


@pytest.mark.slow
def test_four_then_two_then_four_ranks_read_the_same_data(tmp_path: Path, raw_data) -> None:
    # No dropout here: each rank draws its own masks, so another number of ranks draws other ones.
    common = (*raw_data, "model.hidden_dropout=0.0", "checkpoint.interval=2", "checkpoint.keep=10")
    common += ("train.micro_batch_size=2",)
    four, two, back = tmp_path / "four", tmp_path / "two", tmp_path / "back"
    result = run_cli(torchrun_command(4, four, *common, "parallel.dp=4"))
    assert result.returncode == 0, result.stderr
    load = f"checkpoint.load={four / 'checkpoints' / 'step_2'}"
    result = run_cli(torchrun_command(2, two, *common, "parallel.dp=2", "data.num_workers=2", load))
    assert result.returncode == 0, result.stderr
    load = f"checkpoint.load={two / 'checkpoints' / 'step_4'}"
    result = run_cli(torchrun_command(4, back, *common, "parallel.dp=4", "data.num_workers=1", load))
    assert result.returncode == 0, result.stderr
    reference, halved, grown = _losses(four), _losses(two), _losses(back)
    assert sorted(halved) == list(range(3, STEPS + 1)) and sorted(grown) == list(range(5, STEPS + 1))
    for step in (4, 6, 8):  # the position is a function of the step alone, whatever the layout
        assert _position(two, step) == _position(four, step)
    assert _position(back, 8) == _position(four, 8)
    # The first step after each change: same parameters (from the checkpoint), same data, other reduction.
    assert halved[3] == pytest.approx(reference[3], rel=1e-5)
    assert grown[5] == pytest.approx(halved[5], rel=1e-5)
    assert min(abs(reference[s + 1] - reference[s]) for s in range(1, STEPS)) > 1e-3 * reference[1]
