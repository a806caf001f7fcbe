"""Process bodies of the multi-process watchdog tests (importable by torch.multiprocessing's spawn)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from llmtrain.parallel.watchdog import Watchdog, fail_fast

GROUP_TIMEOUT_S = 300
"""Far beyond the watchdog's (seconds) and beyond the tests' deadline (test_watchdog._spawn): the watchdog
or fail_fast, not gloo, must end these jobs, and a machine busy enough to take a minute to start two
processes must not turn that into gloo's timeout."""


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    )


def straggler(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Rank 1 sleeps inside the all-reduce every other rank waits in. fail_fast, as the trainer has it: the
    first rank to exit after its report breaks the others' all-reduce, an error that must not end them
    before their own reports (it would exit 1 instead of 124)."""
    with fail_fast(rank):
        _init(rank, world, port)
        watchdog = Watchdog(timeout_s, rank, world).install().start()  # installed: fail_fast sees it
        grads = torch.ones(4)
        with watchdog.waiting("dp", "all_reduce", detail="grad bucket 0"):
            if rank == 1:
                time.sleep(GROUP_TIMEOUT_S)
            dist.all_reduce(grads)


def crash(rank: int, world: int, port: int) -> None:
    """Rank 1 raises; rank 0 waits in a barrier that can now never complete."""
    with fail_fast(rank):
        _init(rank, world, port)
        if rank == 1:
            raise RuntimeError("boom on rank 1")
        dist.barrier()
