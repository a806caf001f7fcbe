"""A run with multi-token prediction: metrics.jsonl and the progress line carry each depth's loss, and the
loss weight follows its schedule (model.mtp_loss_weight, then mtp_loss_weight_later)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config import load
from llmtrain.training.run import run
from tests.training._runs import CONFIG, TINY, run_cli, torchrun_command

# 8 samples of 32 tokens a step: the weight switches once 256 tokens are trained, from step 2 on.
MTP = ["model.mtp_layers=2", "model.mtp_loss_weight_later=0.1", "model.mtp_loss_weight_tokens=256"]
RUN = ["train.steps=2", "train.eval_interval=0", "logging.interval=1"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_metrics_report_the_loss_of_each_depth(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert run(load(CONFIG, [*TINY, f"output_dir={out}", *RUN, *MTP])).steps == 2
    rows = _rows(out)
    assert [r["mtp_weight"] for r in rows] == [0.3, 0.1]
    for row in rows:
        first, second = row["mtp_loss"]
        # At initialisation every depth predicts about as badly as the main head: near log(vocab).
        assert 0.5 * row["loss"] < first < 2 * row["loss"] and 0.5 * row["loss"] < second < 2 * row["loss"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    first, second = rows[-1]["mtp_loss"]
    assert f"mtp {first:.4f}/{second:.4f}" in lines[-1]


@pytest.mark.slow
def test_a_pipeline_run_reports_the_depths_of_one_process(tmp_path: Path) -> None:
    """The MTP modules sit on pp=2's last stage, which broadcasts each depth's loss with the step's: the
    metrics of a torchrun pp=2 job equal the one-process job's. Both are fp32 and differ only in the order
    micro-batch losses and gradients are summed (a few ulps), which one AdamW step turns into far less than
    1e-5 relative: a depth reported from the wrong stage, unscaled or left at zero would be off by O(1)."""
    one, pipe = tmp_path / "one", tmp_path / "pp2"
    assert run(load(CONFIG, [*TINY, f"output_dir={one}", *RUN, *MTP])).steps == 2
    done = run_cli(torchrun_command(2, pipe, *RUN, *MTP, "parallel.pp=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    for single, piped in zip(_rows(one), _rows(pipe), strict=True):
        assert piped["mtp_weight"] == single["mtp_weight"]
        assert piped["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert piped["mtp_loss"] == pytest.approx(single["mtp_loss"], rel=1e-5)
