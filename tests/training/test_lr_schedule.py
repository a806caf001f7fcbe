"""Learning-rate schedule against hand-computed values."""

import math

import pytest

from llmtrain.config import TrainConfig
from llmtrain.training.lr_schedule import learning_rate


def test_warmup_is_linear_from_zero():
    train = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [learning_rate(train, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_hits_peak_midpoint_and_floor():
    train = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay="cosine")
    assert learning_rate(train, 10) == pytest.approx(1.0)
    assert learning_rate(train, 60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(train, 35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert learning_rate(train, 110) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = TrainConfig(steps=20, lr=2.0, min_lr=0.0, warmup_steps=0, lr_decay="linear")
    assert [learning_rate(linear, s) for s in (0, 5, 10, 20)] == pytest.approx([2.0, 1.5, 1.0, 0.0])
    constant = TrainConfig(steps=20, lr=2.0, min_lr=0.0, warmup_steps=4, lr_decay="constant")
    assert learning_rate(constant, 1) == pytest.approx(1.0) and learning_rate(constant, 15) == 2.0
