"""A NaN loss injected at a chosen step of a real run is skipped and counted; a streak stops the run."""

from __future__ import annotations

import json
import math

import pytest
import torch

import llmtrain.models
from llmtrain.config import load
from llmtrain.training import TrainingDiverged, run

MICRO_BATCHES = 2  # global batch 4 / micro-batch 2 on one process


def tiny_job(tmp_path, steps: int, **overrides):
    items = [f"{k}={v}" for k, v in {
        "model.arch": "gpt", "model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
        "model.seq_length": 32, "model.kernels": "torch", "train.steps": steps, "train.warmup_steps": 1,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.eval_interval": 0,
        "logging.interval": 1, "logging.tensorboard": False, "output_dir": str(tmp_path / "run"), **overrides,
    }.items()]
    return load(None, items)


def poison_steps(monkeypatch, bad_steps: set[int]) -> None:
    """Make models.build return a model whose training loss is NaN during the given (1-based) steps."""
    real_build = llmtrain.models.build
    calls = {"train": 0}

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        step = calls["train"] // MICRO_BATCHES + 1
        calls["train"] += 1
        return output * math.nan if step in bad_steps else output

    def build(cfg):
        model = real_build(cfg)
        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(llmtrain.models, "build", build)


@pytest.mark.slow
def test_nan_step_is_skipped_and_counted(tmp_path, monkeypatch):
    poison_steps(monkeypatch, {3})
    result = run(tiny_job(tmp_path, steps=5))
    entries = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {e["step"]: e for e in entries if "loss" in e}
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    assert by_step[3]["loss"] is None  # NaN, written as null
    assert [by_step[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(by_step[s]["loss"]) for s in (1, 2, 4, 5))
    assert result.steps == 5 and result.skipped_steps == 1 and math.isfinite(result.final_loss)


@pytest.mark.slow
def test_consecutive_nan_steps_stop_the_run_with_a_clear_message(tmp_path, monkeypatch):
    poison_steps(monkeypatch, {2, 3, 4, 5, 6})
    with pytest.raises(TrainingDiverged, match="train.max_bad_steps"):
        run(tiny_job(tmp_path, steps=6, **{"train.max_bad_steps": 2}))
    entries = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == [1, 2]  # stopped at step 3, the second bad step in a row
