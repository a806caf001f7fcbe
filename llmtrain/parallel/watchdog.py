"""Hang and failure diagnostics: every rank says where it waits, and one rank's crash ends the job.

A hung collective blocks every rank that takes part in it, so each rank runs its own `Watchdog`:
code that blocks on other ranks wraps the call in `watchdog.waiting(group, op, detail)`, and a
background thread reports (to stderr) any wait older than the timeout, then ends the process with
`HANG_EXIT_CODE` so torchrun tears the job down. `fail_fast` / `install_excepthook` print an
uncaught exception's traceback tagged with the rank, then exit at once instead of leaving the other
ranks blocked in their next collective until the timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

HANG_EXIT_CODE = 124  # the convention of coreutils' timeout: "ran out of time"
FAILURE_EXIT_CODE = 1
STACK_FRAMES = 6  # innermost frames of a waiting thread shown in a hang report


@dataclass
class Wait:
    """One blocking operation in progress on this rank."""

    group: str
    op: str
    detail: str
    since: float  # time.monotonic() at entry
    thread: int  # threading.get_ident() of the waiting thread

    def describe(self, now: float) -> str:
        text = f"{self.op} on group {self.group!r}"
        if self.detail:
            text += f" ({self.detail})"
        return f"{text}, waiting {now - self.since:.1f}s"


class Watchdog:
    """Per-process record of what this rank waits on, with a thread that reports and exits on a hang.

    `timeout_s` is parallel.timeout_s; `on_hang(report)` replaces the default (print to `stream`, then
    os._exit(HANG_EXIT_CODE)) for tests and for callers that want to abort differently.
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int = 0,
        world_size: int = 1,
        *,
        stream: TextIO | None = None,
        on_hang: Callable[[str], None] | None = None,
        poll_s: float | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s must be positive; got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self.on_hang = on_hang if on_hang is not None else self._report_and_exit
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._waits: dict[int, Wait] = {}  # id(wait) -> wait; several threads may wait at once
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Start the monitoring thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the monitoring thread; waits are still recorded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop.clear()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def waiting(self, group: str, op: str, detail: str = "") -> Iterator[None]:
        """Mark the body as blocked on `op` over process group `group`; `detail` says why (e.g. 'F mb=3')."""
        wait = Wait(group, op, detail, time.monotonic(), threading.get_ident())
        with self._lock:
            self._waits[id(wait)] = wait
        try:
            yield
        finally:
            with self._lock:
                del self._waits[id(wait)]

    def current(self) -> list[Wait]:
        """Waits in progress, oldest first."""
        with self._lock:
            return sorted(self._waits.values(), key=lambda w: w.since)

    def report(self, now: float | None = None) -> str:
        """What this rank waits on, each wait with the Python stack of the thread that waits."""
        now = time.monotonic() if now is None else now
        waits = self.current()
        head = f"[watchdog rank {self.rank}/{self.world_size}]"
        if not waits:
            return f"{head} not waiting on any collective"
        lines = [f"{head} hang: a wait exceeded parallel.timeout_s={self.timeout_s:g}s; this rank waits in:"]
        frames = sys._current_frames()
        for wait in waits:
            lines.append(f"{head}   {wait.describe(now)}")
            frame = frames.get(wait.thread)
            if frame is not None:
                # The innermost frames say where it blocks; the launcher's frames above them are noise.
                stack = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
                lines.extend(f"{head}     {line}" for line in stack.splitlines())
        return "\n".join(lines)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            waits = self.current()
            if waits and time.monotonic() - waits[0].since > self.timeout_s:
                self.on_hang(self.report())
                return

    def _report_and_exit(self, report: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(report, file=stream, flush=True)
        # os._exit, not sys.exit: the main thread is stuck inside a C++ collective and never returns
        # to Python, so only ending the process here frees the job (torchrun then stops the others).
        os._exit(HANG_EXIT_CODE)


def format_failure(rank: int, exc: BaseException) -> str:
    """An exception's traceback with every line tagged by the rank, so it stands out in merged logs."""
    head = f"[rank {rank}]"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    return "\n".join([f"{head} failed; ending the job:"] + [f"{head} {line}" for line in text.splitlines()])


def _die(rank: int, exc: BaseException, stream: TextIO | None) -> None:
    print(format_failure(rank, exc), file=stream if stream is not None else sys.stderr, flush=True)
    # Skip interpreter shutdown: destroying process groups or joining threads can block on peers
    # that are themselves stuck waiting for this rank.
    os._exit(FAILURE_EXIT_CODE)


@contextlib.contextmanager
def fail_fast(rank: int, stream: TextIO | None = None) -> Iterator[None]:
    """Run the body; on any exception print it tagged with `rank` and exit the process at once.

    SystemExit passes through (a deliberate exit, such as a config error's code, is not a crash).
    """
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # KeyboardInterrupt too: the peers would otherwise hang
        _die(rank, exc, stream)


def install_excepthook(rank: int, stream: TextIO | None = None) -> None:
    """Make an uncaught exception in any thread of this process end the process like `fail_fast`."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        _die(rank, exc, stream)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            _die(rank, args.exc_value, stream)

    sys.excepthook = hook
    threading.excepthook = thread_hook
