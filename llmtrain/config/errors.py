"""The one error type for bad configuration."""


class ConfigError(ValueError):
    """A config value is missing, mistyped or inconsistent; the message names the field and the fix."""
