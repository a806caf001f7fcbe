"""When a pipeline rank's point-to-point transfers ran, against its computes: the executor's traced
communication intervals, and how long a rank sat waiting for data after it was produced (exposed).

The executor posts each transfer asynchronously (``isend``/``irecv``) ahead of the compute that needs it
(``lookahead`` computes early for receives, sends right after the compute that produced them) and waits
for a receive only before that compute, for the sends at the end of the step. A traced run records per
transfer ``posted`` (when it was posted), ``needed`` (when the rank reached its wait: for a receive, its
consuming compute is next; for a send, the end of the step) and ``done`` (when that wait returned). gloo's
works report no completion before their wait, so a receive whose data was already there shows as a wait
that returns at once.

A receive's data moves once it is posted and its producer (on the peer rank, one clock for all ranks:
``time.perf_counter`` on one machine) has computed it, and the rank has it by ``done``: the transfer runs
inside ``[max(posted, produced), done]``. A wait that blocked did so first for the producer (the bubble, not
communication), then for the transfer; ``exposed`` counts only the part after the producing compute ended.
``hidden`` receives returned from their wait within ``HIDDEN_WAIT``: their transfer ran while the rank
computed other micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmtrain.pipeline.schedules import RECV_B, RECV_F, Action, B, F, I, Schedule
from llmtrain.pipeline.timeline import Span


@dataclass(frozen=True)
class CommEvent:
    """One traced transfer of one pipeline rank (times in seconds, ``time.perf_counter``)."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    posted: float
    needed: float
    done: float


class CommTrace:
    """The transfers of one traced step on one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict] = []
        self._posted: dict[int, tuple[Action, float]] = {}

    def posted(self, key: int, action: Action) -> None:
        """``action``'s transfer (identified by ``key``, its index in the action list) was just posted."""
        self._posted[key] = (action, time.perf_counter())

    def wait(self, key: int, work: Any) -> None:
        """Wait for ``work`` (the transfer ``key``), recording when it was needed and when it was done."""
        needed = time.perf_counter()
        work.wait()
        done = time.perf_counter()
        action, posted = self._posted.pop(key)
        self.events.append(
            {
                "rank": self.rank,
                "kind": action.kind,
                "microbatch": action.microbatch,
                "chunk": action.chunk,
                "posted": posted,
                "needed": needed,
                "done": done,
            }
        )


HIDDEN_WAIT = 1e-4
"""A receive whose wait returned within this many seconds found its data there: a transfer of one activation
takes longer on gloo (0.33 ms measured for the executor's exchange of one), a wait on arrived data
microseconds."""


def hidden_receives(events: list[CommEvent]) -> tuple[int, int]:
    """(receives whose data was there when the rank needed it, receives)."""
    receives = [e for e in events if e.kind in (RECV_F, RECV_B)]
    return sum(e.done - e.needed <= HIDDEN_WAIT for e in receives), len(receives)


def _production(schedule: Schedule, spans: list[Span]) -> Callable[[CommEvent], float]:
    """A function giving each receive the time its producer (the previous stage's F, or the next stage's B
    or I) ended."""
    ends = {(s.kind, s.microbatch, schedule.stage(s.rank, s.chunk)): s.end for s in spans}

    def produced(e: CommEvent) -> float:
        stage = schedule.stage(e.rank, e.chunk)
        if e.kind == RECV_F:
            return ends[(F, e.microbatch, stage - 1)]
        return ends.get((B, e.microbatch, stage + 1), ends.get((I, e.microbatch, stage + 1), e.posted))

    return produced


def in_flight(
    schedule: Schedule, spans: list[Span], events: list[CommEvent]
) -> list[tuple[int, float, float]]:
    """Per receive, (rank, start, end) of the window its transfer ran in: from when it was both posted and
    produced to when the rank had it."""
    produced = _production(schedule, spans)
    return [(e.rank, max(e.posted, produced(e)), e.done) for e in events if e.kind in (RECV_F, RECV_B)]


def exposed(schedule: Schedule, spans: list[Span], events: list[CommEvent]) -> float:
    """Seconds ranks sat waiting for received data after its producer had finished computing it, summed
    over ranks: the communication the computes did not hide."""
    produced = _production(schedule, spans)
    return sum(max(e.done - max(e.needed, produced(e)), 0.0) for e in events if e.kind in (RECV_F, RECV_B))
