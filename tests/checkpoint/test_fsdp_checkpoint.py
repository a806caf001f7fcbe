"""Checkpoints of ZeRO-3 (FSDP2 shards) load on flat-buffer layouts and the reverse (4 gloo processes).

References as in test_reshard.py: training continued on the layout that saved (losses within 1e-5
relative, fp32: the layouts sum in different orders, nothing else differs), and the saved tensors
themselves (a checkpoint re-saved by another layout holds bitwise the same model and optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import llmtrain
from llmtrain.checkpoint.convert import read_full
from tests.checkpoint.test_reshard import Run, _spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# (tp, pp, dp, zero_stage): ZeRO-3 over all four ranks saves; flat-buffer layouts and ZeRO-3 with TP load.
SAVE = (1, 1, 4, 3)
LOADS = [(2, 1, 2, 0), (1, 1, 4, 1), (2, 1, 2, 3)]


def _round_trips(rank: int, tmp: str) -> None:
    root = Path(tmp)
    a = Run(root / "a", rank, *SAVE)
    a.train(0, 2)
    a.ck.save(2, a.model, a.opt, {"step": 2})
    saved_weights = a.full_weights()
    expected = a.train(2, 4)
    for tp, pp, dp, zero in LOADS:
        b = Run(root / f"b{tp}{dp}{zero}", rank, tp, pp, dp, zero)
        b.ck.load(root / "a", b.model, b.opt)
        b.ck.save(2, b.model, b.opt, {"step": 2})
        got = b.train(2, 4)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=f"losses after loading {SAVE} at {(tp, pp, dp, zero)}")  # fmt: skip
    # ... and back: ZeRO-3 loads what a ZeRO-0 layout wrote and continues like the run that saved.
    back = Run(root / "back", rank, *SAVE)
    back.ck.load(root / "b220" / "checkpoints", back.model, back.opt)
    torch.testing.assert_close(torch.tensor(back.train(2, 4)), torch.tensor(expected), rtol=1e-5, atol=0)
    dist.barrier()
    if rank == 0:
        original = read_full(root / "a" / "checkpoints")
        for tp, _, dp, zero in LOADS:
            again = read_full(root / f"b{tp}{dp}{zero}" / "checkpoints")
            assert original.keys() == again.keys()
            for key, value in original.items():
                assert torch.equal(value, again[key]), f"{key} differs after a trip via {(tp, dp, zero)}"
        # The export path reads the ZeRO-3 checkpoint as one model holding the gathered weights.
        loaded = llmtrain.from_pretrained(root / "a").state_dict()
        for name, value in saved_weights.items():
            assert torch.equal(loaded[name], value), name


def _cp_round_trip(rank: int, tmp: str) -> None:
    """ZeRO-3 sharded over cp=2 x dp=2 saves; ZeRO-3 over dp=4 loads it and continues like the saver, and
    its re-save holds bitwise the same tensors (CP ranks' shards are parts of the state, not copies)."""
    root = Path(tmp)
    a = Run(root / "a", rank, 1, 1, 2, 3, cp=2)
    a.train(0, 2)
    a.ck.save(2, a.model, a.opt, {"step": 2})
    expected = a.train(2, 4)
    b = Run(root / "b", rank, *SAVE)
    b.ck.load(root / "a", b.model, b.opt)
    b.ck.save(2, b.model, b.opt, {"step": 2})
    torch.testing.assert_close(torch.tensor(b.train(2, 4)), torch.tensor(expected), rtol=1e-5, atol=0)
    dist.barrier()
    if rank == 0:
        original, again = read_full(root / "a" / "checkpoints"), read_full(root / "b" / "checkpoints")
        assert original.keys() == again.keys()
        for key, value in original.items():
            assert torch.equal(value, again[key]), f"{key} differs after loading cp=2 dp=2 at dp=4"


def _both(rank: int, tmp: str) -> None:
    """Both round trips in one process group, each in its own folder: starting 4 processes (torch and
    DTensor imported in each, ~6 CPU-s a process) costs as much as a round trip. A rank that fails leaves
    the group, which fails its peers' next collective: the first failure stops the group and fails both
    tests with its traceback."""
    for name, check in (("round_trips", _round_trips), ("cp", _cp_round_trip)):
        folder = Path(tmp, name)
        folder.mkdir(exist_ok=True)
        check(rank, str(folder))


@pytest.fixture(scope="module")
def round_trips() -> Callable[[], None]:
    """Spawns the group at the first test that asks; both tests then raise its error or pass."""
    outcome: list[BaseException | None] = []

    def result() -> None:
        if not outcome:
            try:
                _spawn(_both, lambda tmp: None)
                outcome.append(None)
            except AssertionError as err:
                outcome.append(err)
        if outcome[0] is not None:
            raise outcome[0]

    return result


@pytest.mark.slow
def test_zero3_checkpoints_load_on_other_layouts(round_trips: Callable[[], None]) -> None:
    round_trips()


@pytest.mark.slow
def test_zero3_over_cp_checkpoints_load_without_cp(round_trips: Callable[[], None]) -> None:
    round_trips()
