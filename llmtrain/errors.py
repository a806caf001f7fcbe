"""The base of every error a user can fix by changing an input: a config value, a data file, a checkpoint.

CheckpointError is defined here rather than in llmtrain.checkpoint (which re-exports it) because the
parallel layer below the checkpoints raises it too: tensor layouts (llmtrain.parallel.param_layout) and the
DeepSpeed engine's checkpoint view.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, not a bug: the message alone (one or two lines) names the thing and the fix.

    Tools print just the message (no traceback unless asked, see llmtrain.cli) and exit with `exit_code`.
    """

    exit_code = 2
    same_on_every_launch = False
    """True when a restart of the same command would hit the same error (so it is printed only once)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or tensor and the cause."""
