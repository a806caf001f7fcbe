"""What torchrun tells each worker process through its environment: its rank and the restart count.

A leaf module (standard library only): the tools read it before importing torch (llmtrain.cli), the
library when it joins the job (llmtrain.parallel.launch) and when it resumes (llmtrain.training.output_dir).
"""

from __future__ import annotations

import os


def launch_rank() -> int:
    """This process's global rank as torchrun (or Slurm through torchrun) set it; 0 for a plain `python`."""
    return int(os.environ.get("RANK", "0"))


def launch_attempt() -> int:
    """How many times torchrun restarted this worker group (0 on the first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
