"""Sharded checkpoints: save on any layout, load on any other, verify, convert."""

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.manager import Checkpointer

__all__ = ["CheckpointError", "Checkpointer"]
