"""llmtrain.parallel.turns: the two sides of an overlapped pair compute in turns that change hands only at
hand-off points, each collective issued asynchronously and waited for once its side has the turn back, so
the order of the collectives is fixed by the two computations alone."""

from __future__ import annotations

import pytest

from llmtrain.parallel.turns import handoff, run_pair


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
