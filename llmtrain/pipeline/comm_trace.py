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


def collective_events(rank: int, action: Action, stamps: list[tuple[float, float, float]]) -> list[dict]:
    """The EP all-to-alls ``action`` handed off (llmtrain.parallel.turns.recording's (issued, needed, done)
    triples) as CommEvent fields, posted when issued."""
    key = {"rank": rank, "kind": action.kind, "microbatch": action.microbatch, "chunk": action.chunk}
    return [{**key, "posted": p, "needed": n, "done": d} for p, n, d in stamps]


def computing(spans: list[Span], collectives: list[CommEvent]) -> list[Span]:
    """The intervals each compute of one process really computed: its span less its own all-to-alls (from
    issue to the wait's return the compute either waits or, in an overlapped pair, has passed the turn to
    the other one)."""
    own: dict[tuple[int, str, int, int], list[CommEvent]] = {}
    for c in collectives:
        own.setdefault((c.rank, c.kind, c.microbatch, c.chunk), []).append(c)
    pieces = []
    for s in spans:
        start = s.start
        for c in sorted(own.get((s.rank, s.kind, s.microbatch, s.chunk), []), key=lambda c: c.posted):
            if c.posted > start:
                pieces.append(Span(s.rank, s.kind, s.microbatch, s.chunk, start, c.posted))
            start = max(start, c.done)
        if s.end > start:
            pieces.append(Span(s.rank, s.kind, s.microbatch, s.chunk, start, s.end))
    return pieces


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def collective_overlap(spans: list[Span], collectives: list[CommEvent]) -> tuple[float, float]:
    """(exposed, hidden) seconds of one process's EP all-to-alls: of the union of their intervals (issued to
    the wait's return), the part outside the union of the ``computing`` intervals and the part inside."""
    busy = _union([(s.start, s.end) for s in computing(spans, collectives)])
    comm = _union([(c.posted, c.done) for c in collectives])
    total = sum(end - start for start, end in comm)
    hidden = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in busy)
    return total - hidden, hidden


def nested_collectives(spans: list[Span], collectives: list[CommEvent]) -> list[tuple[CommEvent, Span]]:
    """(all-to-all, compute interval) pairs of one process where the all-to-all of one micro-batch was
    issued before a ``computing`` interval of another micro-batch began and returned after it ended: the
    exchange ran while the other micro-batch computed. Only the order of the time stamps counts."""
    pieces = computing(spans, collectives)
    return [
        (c, p)
        for c in collectives
        for p in pieces
        if p.microbatch != c.microbatch and c.posted < p.start and p.end < c.done
    ]
