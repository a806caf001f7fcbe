"""llmtrain: Megatron-style pretraining of large language models.

Importing the package loads nothing else (tools import llmtrain.cli and answer --help at once).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from llmtrain.models import CausalLM

__version__ = "0.1.0"


def from_pretrained(
    path: str | os.PathLike, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> CausalLM:
    """Load a model in eval mode from a Hugging Face or llmtrain model directory, or from a training
    checkpoint (a step_<N> directory, a checkpoints/ directory or an output_dir) of any layout;
    `model(input_ids)` returns logits. dtype defaults to the stored one."""
    from llmtrain.checkpoint.directory import is_checkpoint

    if is_checkpoint(path):
        from llmtrain.checkpoint.convert import load_model

        return load_model(path, device, dtype)
    from llmtrain.models.hf import from_pretrained as from_model_directory

    return from_model_directory(path, device, dtype)
