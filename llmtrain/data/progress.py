"""Progress of long data preparation, as log lines: what is done, how far, how fast, and how long to go.

Lines, not a redrawn bar: preparation runs under torchrun, Slurm and CI, whose logs are files where a bar's
carriage returns make one unreadable line. A task prints at most one line every `interval` seconds (the
first after `interval`), so a task shorter than that prints only its caller's summary. tqdm, already a
dependency, formats the sizes and durations.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

Log = Callable[[str], None]

INTERVAL_S = 5.0
"""Seconds between progress lines: often enough to show life, rare enough to read in a log."""


def say(line: str) -> None:
    """Print one progress line now (stdout, flushed: a log file shows it as it happens)."""
    print(line, flush=True)


def tag(name: str) -> str:
    """'[name]', naming the rank when a torchrun process other than rank 0 prints (a cache's builder may
    be any rank, and its lines are then the only ones about that work)."""
    rank = os.environ.get("RANK", "0")
    return f"[{name}]" if rank == "0" else f"[{name} rank {rank}]"


def is_local_leader() -> bool:
    """Whether this process speaks for its machine: local rank 0 under torchrun, or a plain process."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def size(nbytes: float) -> str:
    """A byte count for people: '13B', '12.1MB'."""
    return tqdm.format_sizeof(nbytes, "B") if nbytes >= 1000 else f"{nbytes:.0f}B"


def duration(seconds: float) -> str:
    """A duration for people: '0.4 s', '12 s', '3 min 20 s', '2 h 05 min'."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """The state of one task measured in bytes of input, with running counts (documents, tokens, ...).

    `advance` may be called from one thread while another prints `line()` (the tokenizer's heartbeat).
    """

    def __init__(
        self,
        task: str,
        total_bytes: float | None,
        log: Log | None = say,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task, self.total, self.log, self.interval, self.clock = task, total_bytes, log, interval, clock
        self.done = 0.0
        self.counts: dict[str, int] = {}
        self.notes: Callable[[], str] = lambda: ""  # text that ends each line (e.g. skipped records)
        self.start = self._last = clock()
        self._lock = threading.Lock()

    def advance(self, nbytes: float, **counts: int) -> None:
        """Count `nbytes` more of the input as done, and add to the named running counts."""
        with self._lock:
            self.done += nbytes
            for name, n in counts.items():
                self.counts[name] = self.counts.get(name, 0) + n

    @property
    def elapsed(self) -> float:
        """Seconds since the task started."""
        return self.clock() - self.start

    def tick(self) -> None:
        """Print the progress line if `interval` seconds have passed since the last one."""
        if self.log is None:
            return
        now = self.clock()
        with self._lock:
            if now - self._last < self.interval:
                return
            self._last = now
        self.log(self.line())

    def line(self) -> str:
        """'task: 5.10MB of 12.1MB (42%), 312 documents, 1,523,000 tokens, 2.40MB/s, 580k tokens/s, ETA 3 s'
        (the size, rate and ETA are of the input's bytes; the running counts follow, then `notes`)."""
        with self._lock:
            done, counts = self.done, dict(self.counts)
        seconds = max(self.elapsed, 1e-9)
        parts = [size(done)]
        if self.total:
            parts[0] += f" of {size(self.total)} ({min(done / self.total, 1.0):.0%})"
        parts += [f"{n:,} {name}" for name, n in counts.items()]
        parts.append(f"{size(done / seconds)}/s")
        if "tokens" in counts:
            parts.append(f"{tqdm.format_sizeof(counts['tokens'] / seconds)} tokens/s")
        if self.total and done:
            parts.append(f"ETA {duration(max(self.total - done, 0.0) * seconds / done)}")
        notes = self.notes()
        return f"{self.task}: {', '.join(parts)}" + (f"; {notes}" if notes else "")


@contextlib.contextmanager
def heartbeat(report: Callable[[], None], period: float = 0.5) -> Iterator[None]:
    """Call `report()` every `period` seconds from a background thread while the body runs.

    For one long call into a library that releases the GIL (SentencePiece training): the body cannot
    report from inside it. `report` itself decides whether a line is due (e.g. Progress.tick).
    """
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period):
            report()

    thread = threading.Thread(target=loop, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
