"""The one exception type of the checkpoint package (defined in llmtrain.errors: see there why)."""

from llmtrain.errors import CheckpointError

__all__ = ["CheckpointError"]
