"""The one error type for bad data input."""


class DataError(ValueError):
    """A data file, tokenizer or data setting is unusable; the message names the file or field and the fix."""
