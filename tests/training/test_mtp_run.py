"""A run with multi-token prediction: metrics.jsonl and the progress line carry each depth's loss, and the
loss weight follows its schedule (model.mtp_loss_weight, then mtp_loss_weight_later)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config import load
from llmtrain.training.run import run
from tests.training._runs import CONFIG, TINY


@pytest.mark.slow
def test_metrics_report_the_loss_of_each_depth(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    # 8 samples of 32 tokens a step: the weight switches once 256 tokens are trained, from step 2 on.
    overrides = ["model.mtp_layers=2", "model.mtp_loss_weight_later=0.1", "model.mtp_loss_weight_tokens=256"]
    job = load(CONFIG, [*TINY, f"output_dir={out}", "train.steps=2", "train.eval_interval=0",
                        "logging.interval=1", *overrides])  # fmt: skip
    assert run(job).steps == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["mtp_weight"] for r in rows] == [0.3, 0.1]
    for row in rows:
        first, second = row["mtp_loss"]
        # At initialisation every depth predicts about as badly as the main head: near log(vocab).
        assert 0.5 * row["loss"] < first < 2 * row["loss"] and 0.5 * row["loss"] < second < 2 * row["loss"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    first, second = rows[-1]["mtp_loss"]
    assert f"mtp {first:.4f}/{second:.4f}" in lines[-1]
