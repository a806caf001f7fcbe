"""Per-thread state that autograd's device thread reads as the state of the thread waiting on it.

On a GPU autograd runs a backward's nodes on a worker thread of the device, not on the thread that called
``torch.autograd.backward``, which waits meanwhile; on CPU it runs them on the caller's thread. State a
computation keeps per thread (the turn of an overlapped pair, a zero-bubble schedule's "build the deferrable
graph") must reach those nodes either way: a ``CallerLocal`` is a thread-local whose values each thread sets
for itself, and while a thread is inside ``lent()`` (around its backward) a thread that never set any of
them reads the lender's (all of them: a thread with a value of its own reads its own, and defaults). Safe
because the lender is blocked in autograd while the device thread works (it runs only the graph's CPU nodes
meanwhile), so the two never use the state at once; one thread lends at a time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class CallerLocal:
    """Thread-local values with defaults; a thread that set none reads those another thread ``lent()``."""

    def __init__(self, **defaults: Any) -> None:
        self._own = threading.local()
        self._defaults = defaults
        self._lent: dict[str, Any] | None = None

    def get(self, name: str) -> Any:
        """This thread's value of ``name`` (or the default), or, while a thread lends and this one has set
        nothing, the lender's."""
        own, lent = self._own.__dict__, self._lent
        values = lent if lent is not None and not own else own
        return values.get(name, self._defaults[name])

    def set(self, name: str, value: Any) -> None:
        setattr(self._own, name, value)

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """Meanwhile threads that set no value of their own read this thread's (as they are on entry)."""
        if self._lent is not None:
            raise RuntimeError("two threads lend their state at once: autograd's device thread serves one")
        self._lent = dict(self._own.__dict__)
        try:
            yield
        finally:
            self._lent = None
