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
has no turn, and while it works the side's hand-offs issued from a thread without a turn of their own act
for that side (its turn, its record). On CPU autograd runs the backward on the caller's thread, which has
the turn itself. Not run on a GPU yet: tests/parallel/test_turns.py emulates the device thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()
_Record = list[tuple[float, float, float]]


class _Turns:
    """The turn of a pair: side 0 (the first) holds it at the start. ``elsewhere`` is (side, its record)
    while that side waits in a backward that autograd may run on another thread (``backward_elsewhere``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._running = [True, True]
        self.elsewhere: tuple[int, _Record | None] | None = None

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


# The pair this process runs now (run_pair sets it for its duration, one at a time): the only way autograd's
# device thread, which runs none of our code but the backward's, can reach the side it works for.
_pair: _Turns | None = None


@contextlib.contextmanager
def recording(log: _Record) -> Iterator[None]:
    """Append (issued, needed, done) of each collective this thread hands off to ``log`` meanwhile."""
    _local.record = log
    try:
        yield
    finally:
        _local.record = None


@contextlib.contextmanager
def backward_elsewhere() -> Iterator[None]:
    """Around a side's ``torch.autograd.backward``: meanwhile a hand-off from a thread with no turn of its
    own (autograd's device thread on a GPU) acts for this side, with its turn and its record. Outside a pair
    nothing changes.

    Safe because the side's own thread is blocked in autograd while the device thread works (it runs only
    the graph's CPU nodes meanwhile, and a GPU model's all-to-alls are not among them), so the two never
    hand off for the side at once; a recomputation's forward inside the backward runs on the device thread
    too and hands off the same way. The other side's thread has its own turn, and only one pair runs per
    process. The delegation ends when the backward returns or raises."""
    turn = getattr(_local, "turn", None)
    if turn is None:
        yield
        return
    turns, side = turn
    if turns.elsewhere is not None:
        raise RuntimeError("both sides of an overlapped pair in a backward: autograd's device thread is one")
    turns.elsewhere = (side, getattr(_local, "record", None))
    try:
        yield
    finally:
        turns.elsewhere = None


def _acting() -> tuple[tuple[_Turns, int] | None, _Record | None]:
    """The (pair, side) whose turn the calling thread hands off with (None: synchronous) and its record."""
    turn = getattr(_local, "turn", None)
    pair = _pair
    if turn is None and pair is not None and pair.elsewhere is not None:
        side, record = pair.elsewhere
        return (pair, side), record
    return turn, getattr(_local, "record", None)


def handoff(issue: Callable[[bool], Any]) -> None:
    """``issue(async_op)`` a collective: at once (``async_op`` False) outside a pair; inside one
    asynchronously, then the turn goes to the other side and the work is waited for when it comes back."""
    turn, record = _acting()
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
    global _pair
    if _pair is not None:
        raise RuntimeError("an overlapped pair is already running in this process: one at a time")
    turns = _pair = _Turns()
    errors: list[BaseException] = []

    def side_body(side: int, fn: Callable[[], None]) -> None:
        turns.wait(side)
        _local.turn = (turns, side)
        try:
            fn()
        except BaseException as error:  # re-raised on the caller's thread below
            errors.append(error)
        finally:
            _local.turn = None
            turns.finish(side)

    try:
        thread = threading.Thread(target=side_body, args=(0, first), name="overlapped-forward")
        thread.start()
        side_body(1, second)
        thread.join()
    finally:
        _pair = None
    if errors:
        raise errors[0]
