"""tools/pretrain.py run as `python` or torchrun would run it, but each rank forked from the preloaded fork
server (tests.parallel._dist) instead of a fresh interpreter: a rank then costs its training, not ~8 CPU-s
of imports, and there is no launcher process (~3 CPU-s). For tests where what a launch leaves and prints is
checked, not the launcher: the script runs as `__main__` (its exit status, its one-line errors, an uncaught
exception through sys.excepthook), with torchrun's environment for a rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT; rank 0 hosts the store), and, as torchrun's agent does, the first rank to fail has the
others stopped: SIGTERM, SIGKILL 30 s later.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import resource
import runpy
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

from tests.parallel._dist import free_port
from tests.training._runs import PRETRAIN, ROOT, env, pretrain_args

# Also what every rank of the tool imports first (the trainer, checkpointing, DTensor's checkpoint
# planners): ~2 CPU-s more per rank otherwise. Takes effect where this process's fork server is not yet
# running; a server that another test file started serves the same ranks, only slower.
PRELOAD = ["torch", "torch.distributed.tensor", "tests.parallel._dist", "llmtrain.training.run"]
GRACE_S = 30  # torchrun's agent: SIGTERM to the remaining workers, SIGKILL after this


@dataclass
class Launch:
    """What a launch returned: its exit status (0, or the first failed rank's), each rank's exit code
    (negative: the signal that ended it), and its ranks' stdout and stderr, rank 0's first."""

    returncode: int
    exitcodes: list[int]
    stdout: str
    stderr: str


def tiny_pretrain(nproc: int, out: Path, *overrides: str, **options: object) -> Launch:
    """`pretrain` of the tiny job in `out` (tests.training._runs)."""
    return pretrain(nproc, pretrain_args(out, *overrides)[1:], **options)


def pretrain(nproc: int, args: list[str], faults: str = "", file_size_limit: int | None = None) -> Launch:
    """`python tools/pretrain.py *args` with nproc=0, else `torchrun --nproc-per-node=nproc` of it;
    `faults` is LLMTRAIN_FAULTS, `file_size_limit` RLIMIT_FSIZE."""
    from llmtrain.faults import ENV

    environ = {**env(), ENV: faults}
    port = free_port()
    mp.set_forkserver_preload(PRELOAD)
    context = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as logs:
        ranks = [
            context.Process(
                target=_rank,
                args=(rank, nproc, port, args, environ, f"{logs}/{rank}", file_size_limit),
                name=f"pretrain-rank{rank}",
            )
            for rank in range(max(nproc, 1))
        ]
        for process in ranks:
            process.start()
        returncode = _wait(ranks, time.monotonic() + 300)
        stdout = "".join(Path(f"{logs}/{rank}.out").read_text() for rank in range(len(ranks)))
        stderr = "".join(Path(f"{logs}/{rank}.err").read_text() for rank in range(len(ranks)))
    return Launch(returncode, [p.exitcode for p in ranks], stdout, stderr)


def _wait(ranks: list[multiprocessing.process.BaseProcess], deadline: float) -> int:
    """Wait for every rank; once one fails, stop the others as torchrun does; the launch's exit status."""
    running, failed, stop_by = list(ranks), None, None
    while running:
        limit = deadline if stop_by is None else min(deadline, stop_by)
        multiprocessing.connection.wait([p.sentinel for p in running], max(0.0, limit - time.monotonic()))
        for process in [p for p in running if not p.is_alive()]:
            process.join()
            running.remove(process)
            if process.exitcode != 0 and failed is None:
                failed, stop_by = process, time.monotonic() + GRACE_S
                for other in running:
                    other.terminate()
        if running and time.monotonic() >= limit:
            for other in running:
                other.kill()
            for other in running:
                other.join()
            assert time.monotonic() < deadline, "the launch did not end within 300 s"
            running = []
    return 0 if failed is None else failed.exitcode


def _rank(
    rank: int,
    nproc: int,
    port: int,
    args: list[str],
    environ: dict[str, str],
    log: str,
    file_size_limit: int | None,
) -> None:
    # A forked rank has the server's environment and directory: take the test's, and torchrun's for a rank.
    os.environ.clear()
    os.environ.update(environ)
    if nproc:
        world = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc}
        world["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", 1)  # as torchrun sets it
        os.environ.update(
            {k: str(v) for k, v in world.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    os.chdir(ROOT)
    if file_size_limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(f"{log}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [str(PRETRAIN), *args]
    try:
        runpy.run_path(str(PRETRAIN), run_name="__main__")  # exits with the tool's status
    except Exception:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception (the job's hook)
        raise SystemExit(1) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
