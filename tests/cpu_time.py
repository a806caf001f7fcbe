"""CPU seconds a command costs: what "answers at once" means on a machine that other jobs load.

Wall-clock time on a 2-core CI machine running several test processes measures the queue, not the
command, so a bound on it fails at random; the CPU time the command itself uses does not depend on load.
"""

from __future__ import annotations

import resource
import subprocess
from typing import Any


def run_counting_cpu(command: list[str], **kwargs: Any) -> tuple[subprocess.CompletedProcess, float]:
    """subprocess.run(command, **kwargs) and the user + system CPU seconds of the process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
