"""Two computations of one rank taking turns at their expert all-to-alls (DualPipeV's overlapped pair).

A pipeline rank runs the forward of one micro-batch and the backward of another on two threads that hand
one turn back and forth: only the holder computes, the other waits. At a hand-off point (``handoff``: the
expert-parallel all-to-all) the holder issues its collective asynchronously, passes the turn, and waits for
the collective's work only once the turn is back, so the exchange runs while the other side computes.
Turns change hands only there, so the order in which a rank issues its collectives follows from the two
computations alone, the same on every rank that runs the same pair (gloo and NCCL match collectives by
order). Outside a pair ``handoff`` runs the collective synchronously.

A thread that ``records`` into a list gets one (issued, needed, done) ``time.perf_counter`` triple per
collective it hands off: issued, the turn back and its wait begun, the wait returned (a synchronous one:
issued = needed). The turn and the record are the calling thread's. A side that runs a backward does so
inside ``backward_elsewhere``: on a GPU autograd runs the backward on its device's own worker thread, which
has no turn, and while it works that thread's hand-offs act for the side (its turn, its record: a
CallerLocal the side lends, llmtrain.parallel.thread_state). On CPU autograd runs the backward on the
caller's thread, which has the turn itself. Not run on a GPU yet: tests/parallel/test_turns.py emulates the
device thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from llmtrain.parallel.thread_state import CallerLocal

_local = CallerLocal(turn=None, record=None)
_Record = list[tuple[float, float, float]]


class _Turns:
    """The turn of a pair: side 0 (the first) holds it at the start."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._running = [True, True]

    def wait(self, side: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == side)

    def hand_over(self, side: int) -> None:
        """Pass the turn to the other side, if it is still running, and wait until it comes back."""
        with self._cond:
            if not self._running[1 - side]:
                return
            self._holder = 1 - side
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == side)

    def finish(self, side: int) -> None:
        with self._cond:
            self._running[side] = False
            self._holder = 1 - side
            self._cond.notify_all()


@contextlib.contextmanager
def recording(log: _Record) -> Iterator[None]:
    """Append (issued, needed, done) of each collective this thread hands off to ``log`` meanwhile."""
    _local.set("record", log)
    try:
        yield
    finally:
        _local.set("record", None)


@contextlib.contextmanager
def backward_elsewhere() -> Iterator[None]:
    """Around a side's ``torch.autograd.backward``: meanwhile a hand-off from a thread with no turn of its
    own (autograd's device thread on a GPU) acts for this side, with its turn and its record; a
    recomputation's forward inside the backward runs on that thread too and hands off the same way. Outside
    a pair nothing changes. The other side's thread has its own turn; the delegation ends when the backward
    returns or raises, and two sides in a backward at once are refused (autograd's device thread is one)."""
    if _local.get("turn") is None:
        yield
        return
    with _local.lent():
        yield


def handoff(issue: Callable[[bool], Any]) -> None:
    """``issue(async_op)`` a collective: at once (``async_op`` False) outside a pair; inside one
    asynchronously, then the turn goes to the other side and the work is waited for when it comes back."""
    turn, record = _local.get("turn"), _local.get("record")
    issued = time.perf_counter()
    if turn is None:
        issue(False)
        needed = issued
    else:
        pending = issue(True)
        turns, side = turn
        turns.hand_over(side)
        needed = time.perf_counter()
        pending.wait()
    if record is not None:
        record.append((issued, needed, time.perf_counter()))


def run_pair(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run ``first`` on a new thread and ``second`` on this one, taking turns at ``handoff`` points
    (``first`` starts); returns when both are done, raising the first error of either."""
    turns = _Turns()
    errors: list[BaseException] = []

    def side_body(side: int, fn: Callable[[], None]) -> None:
        turns.wait(side)
        _local.set("turn", (turns, side))
        try:
            fn()
        except BaseException as error:  # re-raised on the caller's thread below
            errors.append(error)
        finally:
            _local.set("turn", None)
            turns.finish(side)

    thread = threading.Thread(target=side_body, args=(0, first), name="overlapped-forward")
    thread.start()
    side_body(1, second)
    thread.join()
    if errors:
        raise errors[0]
