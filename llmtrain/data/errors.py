"""The one error type for bad data input."""

from llmtrain.errors import UserError


class DataError(UserError, ValueError):
    """A data file, tokenizer or data setting is unusable; the message names the file or field and the fix."""
