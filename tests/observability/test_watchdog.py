"""Watchdog: hang reports naming the waiting collective, and fail-fast exits with the rank's traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.multiprocessing as mp

from llmtrain.parallel.watchdog import FAILURE_EXIT_CODE, HANG_EXIT_CODE, Watchdog, format_failure
from tests.observability import _dist_workers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_report_names_group_op_detail_and_stack():
    watchdog = Watchdog(600, rank=3, world_size=8)
    with watchdog.waiting("pp", "recv", detail="F mb=2 chunk=0 from rank 2"):
        report = watchdog.report()
    assert "[watchdog rank 3/8]" in report
    assert "recv on group 'pp' (F mb=2 chunk=0 from rank 2)" in report
    assert "test_report_names_group_op_detail_and_stack" in report  # the waiting thread's stack
    assert watchdog.current() == []
    assert "not waiting" in watchdog.report()


def test_fires_once_on_a_wait_past_the_timeout_and_not_on_short_ones():
    reports: list[str] = []
    fired = threading.Event()

    def on_hang(report: str) -> None:
        reports.append(report)
        fired.set()

    with Watchdog(0.3, rank=0, world_size=2, on_hang=on_hang, poll_s=0.02) as watchdog:
        for _ in range(3):
            with watchdog.waiting("dp", "all_reduce"):
                time.sleep(0.05)
        assert not fired.is_set()
        with watchdog.waiting("tp", "all_gather", detail="layer 3 attention"):
            assert fired.wait(5.0)
    assert len(reports) == 1
    assert "all_gather on group 'tp' (layer 3 attention), waiting 0." in reports[0]


def test_rejects_non_positive_timeout():
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        Watchdog(0)


def test_format_failure_tags_every_line_with_the_rank():
    try:
        raise ValueError("bad shard")
    except ValueError as exc:
        text = format_failure(5, exc)
    lines = text.splitlines()
    assert all(line.startswith("[rank 5]") for line in lines)
    assert lines[-1] == "[rank 5] ValueError: bad shard"


@pytest.mark.slow
def test_excepthook_ends_the_process_with_the_traceback():
    code = (
        "from llmtrain.parallel.watchdog import install_excepthook\n"
        "install_excepthook(2)\n"
        "import threading\n"
        "def work(): raise KeyError('missing')\n"
        "t = threading.Thread(target=work); t.start(); t.join()\n"
        "import time; time.sleep(30)\n"
    )  # never reached: the thread's exception ends the process
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == FAILURE_EXIT_CODE
    assert time.monotonic() - start < 25
    assert "[rank 2] KeyError: 'missing'" in proc.stderr


def _spawn(fn, args: tuple, nprocs: int = 2, deadline_s: float = 40.0) -> tuple[list[int | None], float]:
    """Start the ranks and wait for each one (mp.spawn's join would kill the rest at the first exit)."""
    start = time.monotonic()
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    for process in context.processes:
        process.join(max(deadline_s - (time.monotonic() - start), 0.1))
    codes = [p.exitcode for p in context.processes]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    return codes, time.monotonic() - start


@pytest.mark.slow
def test_simulated_hang_every_rank_reports_its_wait_and_exits(capfd):
    codes, elapsed = _spawn(_dist_workers.straggler, (2, free_port(), 2.0))
    err = capfd.readouterr().err
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], err
    assert elapsed < _dist_workers.GROUP_TIMEOUT_S  # the watchdog ended it, not gloo's own timeout
    for rank in (0, 1):
        assert f"[watchdog rank {rank}/2]   all_reduce on group 'dp' (grad bucket 0), waiting" in err
    rank0 = [line for line in err.splitlines() if line.startswith("[watchdog rank 0/2]")]
    assert any("dist.all_reduce(grads)" in line for line in rank0)  # rank 0 is inside the collective
    rank1 = [line for line in err.splitlines() if line.startswith("[watchdog rank 1/2]")]
    assert any("time.sleep" in line for line in rank1)  # rank 1 is the straggler


@pytest.mark.slow
def test_exception_on_one_rank_ends_the_job_promptly_with_its_traceback_first(capfd):
    codes, elapsed = _spawn(_dist_workers.crash, (2, free_port()))
    err = capfd.readouterr().err
    assert codes == [FAILURE_EXIT_CODE, FAILURE_EXIT_CODE], err
    assert elapsed < _dist_workers.GROUP_TIMEOUT_S / 2  # not left blocked until the collective timeout
    assert "[rank 1] RuntimeError: boom on rank 1" in err
    assert err.index("[rank 1] failed") < err.index("[rank 0] failed")  # the cause first, then its echo
