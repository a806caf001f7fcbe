"""SIGINT and SIGTERM during training (Ctrl-C, Slurm preemption, torchrun shutting a job down).

While training, `StopRequest` turns the first SIGINT or SIGTERM into a request: the handler only records
the signal, and the trainer reads it at each step boundary, agrees on it across ranks (in the all-reduce
the step already does), finishes the step, saves a checkpoint and ends with exit status 128 + signal
(130 for SIGINT, 143 for SIGTERM). A second SIGINT exits at once without saving, for a person who does
not want to wait; a repeated SIGTERM is ignored, because Slurm signals every process of a job step and
torchrun forwards the same signal again. Processes forked while training (DataLoader workers) inherit
the handler and ignore the signal: Ctrl-C reaches the whole process group, and the workers must go on
serving batches until the step and the save are done. Outside training the previous handlers are in place.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, TextIO

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by `signum` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class StopRequest:
    """The signal that asked training to stop (0: none yet), recorded by handlers installed by `with`."""

    def __init__(self, announce: bool = True, stream: TextIO | None = None) -> None:
        self.signum = 0
        self.announce = announce
        self.stream = stream
        self._previous: dict[int, Any] = {}
        self._owner = os.getpid()

    def __enter__(self) -> StopRequest:
        # Python runs signal handlers in the main thread only; elsewhere (a test harness) none is installed.
        if threading.current_thread() is threading.main_thread():
            self._owner = os.getpid()
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _say(self, text: str) -> None:
        if self.announce:
            print(text, file=self.stream if self.stream is not None else sys.stderr, flush=True)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:  # a forked child (DataLoader worker): the parent decides
            return
        name = signal.Signals(signum).name
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            self._say(f"{name} again: exiting now without saving; the last complete checkpoint is kept")
            os._exit(exit_code(signum))
        if self.signum:
            return
        self.signum = signum
        again = " (Ctrl-C again to exit at once without saving)" if signum == signal.SIGINT else ""
        self._say(f"{name} received: finishing this step, then saving a checkpoint{again}")
