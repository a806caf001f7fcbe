"""The one exception type of the checkpoint package."""

from llmtrain.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or tensor and the cause."""
