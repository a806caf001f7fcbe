"""Watchdog: hang reports naming the waiting collective and the ranks not arrived, and fail-fast exits."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain.config import ConfigError, load
from llmtrain.faults import ENV
from llmtrain.parallel import watchdog as watchdog_module
from llmtrain.parallel.watchdog import (
    FAILURE_EXIT_CODE,
    GATHER_S,
    HANG_EXIT_CODE,
    Watchdog,
    dump_flight_recorder,
    enable_flight_recorder,
    flight_recorder_env,
    format_failure,
    process_group_timeout,
)
from tests.observability import _dist_workers
from tests.parallel._dist import free_port


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
    with pytest.raises(ValueError, match="train.hang_timeout_s"):
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
        "import time; time.sleep(3600)\n"
    )  # never reached: the thread's exception ends the process (else the timeout below fails the test)
    # The timeout is a safety net, not a measure: starting Python with torch took over 60 s on 2 shared cores.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == FAILURE_EXIT_CODE
    assert "[rank 2] KeyError: 'missing'" in proc.stderr


def _spawn(fn, args: tuple, nprocs: int = 2, deadline_s: float = 240.0) -> list[int | None]:
    """Start the ranks and wait for each one (mp.spawn's join would kill the rest at the first exit); their
    exit codes, None for a rank still running at the deadline. The deadline comes before gloo's own timeout
    (GROUP_TIMEOUT_S), so a code says the watchdog or fail_fast ended the rank, not that timeout; it is a
    safety net, not a measure of speed (these jobs end seconds after their processes start, which took
    over 40 s on 2 cores shared with a full test run)."""
    start = time.monotonic()
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    for process in context.processes:
        process.join(max(deadline_s - (time.monotonic() - start), 0.1))
    codes = [p.exitcode for p in context.processes]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    return codes


@pytest.mark.slow
def test_simulated_hang_every_rank_reports_its_wait_and_exits(capfd):
    codes = _spawn(_dist_workers.straggler, (2, free_port(), 2.0))
    err = capfd.readouterr().err
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], err  # the watchdog ended it, not gloo's own timeout
    for rank in (0, 1):
        assert f"[watchdog rank {rank}/2]   all_reduce on group 'dp' (grad bucket 0), waiting" in err
    rank0 = [line for line in err.splitlines() if line.startswith("[watchdog rank 0/2]")]
    assert any("dist.all_reduce(grads)" in line for line in rank0)  # rank 0 is inside the collective
    rank1 = [line for line in err.splitlines() if line.startswith("[watchdog rank 1/2]")]
    assert any("time.sleep" in line for line in rank1)  # rank 1 is the straggler


@pytest.mark.slow
def test_exception_on_one_rank_ends_the_job_promptly_with_its_traceback_first(capfd):
    codes = _spawn(_dist_workers.crash, (2, free_port()))
    err = capfd.readouterr().err
    assert codes == [FAILURE_EXIT_CODE, FAILURE_EXIT_CODE], err  # not left blocked until gloo's timeout
    assert "[rank 1] RuntimeError: boom on rank 1" in err
    assert err.index("[rank 1] failed") < err.index("[rank 0] failed")  # the cause first, then its echo


class FakeGroup:
    """Stands for a c10d process group: the watchdog reads its name and its members' global ranks."""

    def __init__(self, group_name: str, ranks: list[int]) -> None:
        self.group_name, self.ranks = group_name, ranks


@pytest.fixture
def dp_group(monkeypatch) -> FakeGroup:
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: group.ranks)
    monkeypatch.delenv(ENV, raising=False)
    return FakeGroup("5", [0, 1, 2, 3])


def issued(rank: int, group: FakeGroup, count: int, nbytes: int = 2048) -> Watchdog:
    """A watchdog of `rank` that has issued `count` all-reduces on `group`, named 'dp'."""
    watchdog = Watchdog(600, rank=rank, world_size=4)
    watchdog.name_group(group, "dp")
    for _ in range(count):
        watchdog.finished(watchdog.enter(group, "all_reduce", nbytes))
    return watchdog


def test_a_numbered_wait_names_its_size_and_the_ranks_that_have_not_arrived(dp_group):
    watchdog = issued(0, dp_group, 2)
    waiting_in = watchdog.enter(dp_group, "all_reduce", 2048)
    with watchdog.waiting("dp", "all_reduce", "gradients of bucket 0", collective=waiting_in):
        peers = {r: issued(r, dp_group, 2 if r == 2 else 3).progress() for r in (1, 2)}
        peers[0] = watchdog.progress()  # rank 3 published nothing
        report = watchdog.report(peers=peers, cause="rank 0 waited 11.0s")
    lines = [line.removeprefix("[watchdog rank 0/4] ") for line in report.splitlines()]
    assert lines[0] == "hang: rank 0 waited 11.0s"
    assert lines[2].startswith("  all_reduce #3 on group 'dp' (2.0 KiB; gradients of bucket 0), waiting 0.")
    assert lines[3] == "    not arrived: rank 2 (last entered on 'dp': rank 2: #2)"
    assert lines[4] == "    rank 3: no progress reported (dead, or stuck holding the Python GIL)"
    assert "every rank (3 of 4 reported their progress):" in lines
    assert "  rank 0: in all_reduce #3 on group 'dp' (2.0 KiB; gradients of bucket 0)" in lines
    assert "  rank 1: in no recorded wait; last entered all_reduce #3 (2.0 KiB) on 'dp'" in lines
    assert "  rank 2: in no recorded wait; last entered all_reduce #2 (2.0 KiB) on 'dp'" in lines
    assert "  rank 3: no progress reported (dead, or stuck holding the Python GIL)" in lines


def test_the_rank_that_never_arrived_says_where_the_others_wait(dp_group):
    late = issued(2, dp_group, 2)
    peers = {2: late.progress()}
    for r in (0, 1, 3):
        peer = issued(r, dp_group, 2)
        with peer.waiting(
            "dp", "all_reduce", "bucket 0", collective=peer.enter(dp_group, "all_reduce", 4096)
        ):
            peers[r] = peer.progress()
    report = late.report(peers=peers, cause="rank 1 waited 10.5s in all_reduce #3")
    assert "[watchdog rank 2/4] this rank is in no recorded wait (idle " in report
    assert "test_the_rank_that_never_arrived_says_where_the_others_wait" in report  # its main thread's stack
    assert (
        "[watchdog rank 2/4]   this rank has not arrived at all_reduce #3 on group 'dp' (4.0 KiB; bucket 0), "
        "where ranks 0-1,3 wait (it entered #2 on 'dp')"
    ) in report
    assert "[watchdog rank 2/4]   ranks 0-1,3: in all_reduce #3 on group 'dp' (4.0 KiB; bucket 0)" in report


def test_a_host_sync_is_compared_with_the_count_on_its_group(dp_group):
    watchdog = issued(0, dp_group, 3)
    peers = {r: issued(r, dp_group, 2 if r == 2 else 3).progress() for r in (1, 2, 3)}
    with watchdog.waiting("dp", "host sync", "loss"):
        peers[0] = watchdog.progress()
        report = watchdog.report(peers=peers, cause="c")
    assert "[watchdog rank 0/4]   host sync on group 'dp' (loss), waiting" in report
    assert "[watchdog rank 0/4]     not arrived: rank 2 (last entered on 'dp': rank 2: #2)" in report
    with watchdog.waiting("local", "data-loader fetch", "step 3"):
        report = watchdog.report(peers=peers, cause="c")
    assert "[watchdog rank 0/4]   data-loader fetch on group 'local' (step 3), waiting" in report
    assert "not arrived" not in report  # a local wait expects no other rank


def test_a_receive_names_the_state_of_the_rank_it_expects(dp_group):
    watchdog = issued(1, dp_group, 1)
    sender = issued(0, dp_group, 1)
    with sender.waiting("local", "data-loader fetch"):
        peers = {0: sender.progress()}
    with watchdog.waiting("pp", "recv", "F mb=2 chunk=0 from pp rank 0", peer=0):
        report = watchdog.report(peers=peers, cause="c")
    assert "expects rank 0, which is in data-loader fetch on group 'local'" in report


class _Stalls:
    """Stands for the watchdog module's `threading` in `enter`: the hang fault stalls with
    threading.Event().wait(seconds), which this records instead of waiting."""

    def __init__(self) -> None:
        self.seconds: list[float | None] = []

    def Event(self) -> _Stalls:  # noqa: N802 (threading's name)
        return self

    def wait(self, seconds: float | None) -> bool:
        self.seconds.append(seconds)
        return False


def test_the_hang_fault_stalls_the_matching_collective_only(dp_group, monkeypatch):
    monkeypatch.setenv(ENV, "hang:rank=0:group=dp:seq=2:seconds=0.5,hang:step=4:seconds=0.5")
    watchdog = issued(0, dp_group, 0)
    recorded = _Stalls()
    monkeypatch.setattr(watchdog_module, "threading", recorded)
    stalls = []
    for step in (1, 2, 3, 4):
        watchdog.at_step(step)
        before = len(recorded.seconds)
        watchdog.enter(dp_group, "all_reduce", 4)
        stalls.append(recorded.seconds[before:])
    assert stalls == [[], [0.5], [], [0.5]]  # the fault's own seconds, on the matching collectives only
    assert watchdog.progress()["groups"]["5"]["entered"] == 4


def test_a_wait_of_any_kind_past_the_timeout_fires():
    fired = threading.Event()
    with Watchdog(0.3, on_hang=lambda report: fired.set(), poll_s=0.02) as watchdog:
        with watchdog.waiting("local", "data-loader fetch", "step 7"):
            assert fired.wait(5.0)


def test_the_flight_recorder_is_switched_on_for_nccl_only_and_never_over_the_user(tmp_path):
    reports = tmp_path / "hang_reports"
    assert flight_recorder_env("gloo", reports, {}) == {}
    prefix = str(reports / "flight_recorder" / "trace_rank_")
    assert flight_recorder_env("nccl", reports, {}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    user = {
        "TORCH_FR_BUFFER_SIZE": "50",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    assert flight_recorder_env("nccl", reports, user) == {}
    assert flight_recorder_env("nccl", None, {}) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    }


def test_enabling_the_flight_recorder_makes_its_folder(tmp_path, monkeypatch):
    for name in flight_recorder_env("nccl", tmp_path, {}):
        monkeypatch.delenv(name, raising=False)
    enable_flight_recorder("nccl", tmp_path / "hang_reports")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert (tmp_path / "hang_reports" / "flight_recorder").is_dir()  # PyTorch's dump does not create it
    assert dump_flight_recorder(tmp_path / "trace")  # torch's generic recorder, empty without a job
    assert pickle.loads((tmp_path / "trace").read_bytes())["entries"] == []
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert not dump_flight_recorder(tmp_path / "none")


def test_the_process_group_timeout_comes_after_the_report():
    for hang_s in (1.0, 10.0, 300.0, 3600.0):
        # poll (<= 1 s) + the progress exchange (GATHER_S) + waiting for the slower readers (GATHER_S)
        assert process_group_timeout(hang_s).total_seconds() > hang_s + 1 + 2 * GATHER_S


def test_the_timeout_is_train_hang_timeout_s_and_the_old_key_says_so():
    assert load(overrides=["train.hang_timeout_s=12.5"]).train.hang_timeout_s == 12.5
    with pytest.raises(ConfigError, match=r"^train.hang_timeout_s must be positive \(seconds\); got 0.0$"):
        load(overrides=["train.hang_timeout_s=0"])
    with pytest.raises(
        ConfigError, match=r"^parallel.timeout_s was replaced by train.hang_timeout_s; set that"
    ):
        load(overrides=["parallel.timeout_s=600"])
