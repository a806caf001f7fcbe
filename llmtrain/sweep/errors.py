"""The error type for a bad sweep description (grid, list file, options)."""

from llmtrain.errors import UserError


class SweepError(UserError, ValueError):
    """The sweep's own input is wrong; the message names the option or file and the fix."""

    same_on_every_launch = True
