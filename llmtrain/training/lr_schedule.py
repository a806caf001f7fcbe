"""Learning rate as a function of the step: linear warmup, then cosine, linear or constant decay."""

from __future__ import annotations

import math

from llmtrain.config import TrainConfig


def learning_rate(train: TrainConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of train.steps steps."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_decay == "constant":
        return train.lr
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    if train.lr_decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * factor
