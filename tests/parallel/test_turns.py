"""llmtrain.parallel.turns: the two sides of an overlapped pair compute in turns that change hands only at
hand-off points, each collective issued asynchronously and waited for once its side has the turn back, so
the order of the collectives is fixed by the two computations alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest
import torch

from llmtrain.parallel.turns import backward_elsewhere, handoff, recording, run_pair


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _side(log: list[str], name: str, collectives: int):
    def run() -> None:
        for c in range(collectives):
            log.append(f"{name} computes {c}")

            def issue(async_op: bool, c: int = c) -> _Work | None:
                log.append(f"{name} issues {c} {'async' if async_op else 'sync'}")
                return _Work(log, f"{name}{c}") if async_op else None

            handoff(issue)
        log.append(f"{name} done")

    return run


_ALTERNATING = [
    "F computes 0", "F issues 0 async",
    "B computes 0", "B issues 0 async",
    "wait F0", "F computes 1", "F issues 1 async",
    "wait B0", "B computes 1", "B issues 1 async",
    "wait F1", "F done",
    "wait B1", "B computes 2", "B issues 2 async",  # F is done: B keeps the turn
    "wait B2", "B done",
]  # fmt: skip


def test_turns_alternate_at_collectives_and_waits_follow_the_turn():
    log: list[str] = []
    run_pair(_side(log, "F", 2), _side(log, "B", 3))
    assert log == _ALTERNATING


def test_outside_a_pair_the_collective_runs_at_once():
    log: list[str] = []
    _side(log, "F", 1)()
    assert log == ["F computes 0", "F issues 0 sync", "F done"]


def test_an_error_on_either_side_reaches_the_caller_and_frees_the_other():
    def fails() -> None:
        raise ValueError("forward failed")

    log: list[str] = []
    with pytest.raises(ValueError, match="forward failed"):
        run_pair(fails, _side(log, "B", 2))
    assert log[-1] == "B done"


def test_recording_stamps_each_collective_issued_then_turn_back_then_done():
    log: list[str] = []
    stamps: list[tuple[float, float, float]] = []

    def forward() -> None:
        with recording(stamps):
            _side(log, "F", 2)()

    run_pair(forward, _side(log, "B", 1))
    outside: list[tuple[float, float, float]] = []
    with recording(outside):
        _side(log, "F", 1)()
    # Only the recording thread's collectives: F's two inside the pair, each issued before the turn came back
    # (B computed meanwhile), and one synchronous one outside, needed as it was issued.
    assert len(stamps) == 2 and all(issued < needed <= done for issued, needed, done in stamps)
    assert len(outside) == 1 and outside[0][0] == outside[0][1] <= outside[0][2]


class _DeviceThreadBackward(torch.autograd.Function):
    """Identity whose backward runs ``work`` on a thread of its own and joins it: the caller blocked while
    another thread works, as autograd's device thread leaves the caller of a backward on a GPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, work: Callable[[], None]) -> torch.Tensor:
        ctx.work = work
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                ctx.work()
            except BaseException as error:  # re-raised on autograd's thread below
                errors.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return grad, None


def _backward_on_device_thread(work: Callable[[], None]) -> None:
    """A side running a backward, as the executor's _backward does, whose ``work`` runs on another thread."""
    x = torch.zeros(1, requires_grad=True)
    with backward_elsewhere():
        _DeviceThreadBackward.apply(x, work).sum().backward()


def test_a_backward_on_a_device_thread_takes_turns_and_records_as_on_the_callers():
    log: list[str] = []
    stamps: list[tuple[float, float, float]] = []

    def backward() -> None:
        with recording(stamps):
            _backward_on_device_thread(_side(log, "B", 3))

    run_pair(_side(log, "F", 2), backward)
    assert log == _ALTERNATING
    # B's three hand-offs, recorded though issued from the other thread: the first two waited for the turn
    # (F computed meanwhile), the last kept it (F was done).
    assert len(stamps) == 3 and all(issued < needed <= done for issued, needed, done in stamps[:2])


@pytest.mark.parametrize("fails", [False, True])
def test_the_delegation_ends_with_the_backward(fails: bool):
    log: list[str] = []

    def work() -> None:
        if fails:
            raise ValueError("backward failed")

    def foreign(name: str) -> None:
        thread = threading.Thread(target=_side(log, name, 1))
        thread.start()
        thread.join()

    def backward() -> None:
        with contextlib.suppress(ValueError):
            _backward_on_device_thread(work)
        foreign("after")  # the pair still runs, but no side is in a backward: synchronous

    run_pair(_side(log, "F", 1), backward)
    foreign("outside")
    assert log == [
        "F computes 0", "F issues 0 async", "after computes 0", "after issues 0 sync", "after done",
        "wait F0", "F done", "outside computes 0", "outside issues 0 sync", "outside done",
    ]  # fmt: skip
