"""SplitBackward's building flag across threads: autograd's device thread (GPUs) recomputing a forward inside
an I builds the deferrable graph as the caller waiting in the backward does; a thread with its own flag (an
overlapped pair's forward) keeps it. Emulated on CPU with plain threads, as tests/parallel/test_turns.py
emulates the device thread."""

import threading

from llmtrain.pipeline.split_backward import SplitBackward


def _read_on_a_new_thread(split: SplitBackward, own: bool | None = None) -> bool:
    seen = []

    def body() -> None:
        if own is not None:
            split.building = own
        seen.append(split.building)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_without_its_own_flag_builds_as_the_caller_in_its_backward():
    split = SplitBackward()
    split.building = True  # the caller runs an I
    assert not _read_on_a_new_thread(split)  # no backward running: nothing to act for
    with split.in_backward():
        assert _read_on_a_new_thread(split)
        assert not _read_on_a_new_thread(split, own=False)  # a pair's forward thread keeps its own
    assert not _read_on_a_new_thread(split)
    split.building = False  # a B: its recomputation builds plain layers
    with split.in_backward():
        assert not _read_on_a_new_thread(split)


def test_the_delegation_ends_when_the_backward_raises():
    split = SplitBackward()
    split.building = True
    try:
        with split.in_backward():
            raise RuntimeError("backward failed")
    except RuntimeError:
        pass
    assert not _read_on_a_new_thread(split)
