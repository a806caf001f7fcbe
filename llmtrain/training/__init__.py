"""The training loop and the wiring of a whole job.

Names are imported on first use, so that reading metrics (llmtrain.training.metrics_file) needs no torch.
The job entry point is `llmtrain.training.run.run` (a package attribute `run` would be shadowed by the
submodule of that name as soon as it is imported).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Trainer": "llmtrain.training.trainer",
    "TrainingDiverged": "llmtrain.training.trainer",
    "TrainResult": "llmtrain.training.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmtrain.training' has no attribute {name!r}")
