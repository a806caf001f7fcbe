"""The one exception type of the checkpoint package."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or tensor and the cause."""
