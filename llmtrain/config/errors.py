"""The one error type for bad configuration."""

from llmtrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is missing, mistyped or inconsistent; the message names the field and the fix."""

    same_on_every_launch = True
