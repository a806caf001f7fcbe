"""llmtrain.parallel.turns: the two sides of an overlapped pair compute in turns that change hands only at
hand-off points, each collective issued asynchronously and waited for once its side has the turn back, so
the order of the collectives is fixed by the two computations alone."""

from __future__ import annotations

import pytest

from llmtrain.parallel.turns import handoff, recording, run_pair


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


def test_turns_alternate_at_collectives_and_waits_follow_the_turn():
    log: list[str] = []
    run_pair(_side(log, "F", 2), _side(log, "B", 3))
    assert log == [
        "F computes 0", "F issues 0 async",
        "B computes 0", "B issues 0 async",
        "wait F0", "F computes 1", "F issues 1 async",
        "wait B0", "B computes 1", "B issues 1 async",
        "wait F1", "F done",
        "wait B1", "B computes 2", "B issues 2 async",  # F is done: B keeps the turn
        "wait B2", "B done",
    ]  # fmt: skip


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
