"""A rank that stops before a collective: every rank reports the wait and the rank not arrived, then exits.

The tiny pretraining job runs on 4 gloo ranks under torchrun (dp=4, one gradient bucket, so the n-th
all-reduce on the 'dp' group is step n's gradient reduction); the `hang` fault of llmtrain/faults.py stops
rank 2 just before the third. The reports are checked against PyTorch's own flight recorder, which
records every gloo collective independently of llmtrain's numbering (TORCH_FR_BUFFER_SIZE). The same launch
stalls rank 1 for half the timeout before the second: a stall shorter than the timeout is no hang, so the
reports must all be of the third (a report on the stall would have ended the job there).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.training._runs import ROOT, env, torchrun_command

HANG_TIMEOUT_S = 10


def _run(nproc: int, out: Path, fault: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    variables = {**env(), "LLMTRAIN_FAULTS": fault, "TORCH_FR_BUFFER_SIZE": "200"}
    start = time.monotonic()
    proc = subprocess.run(
        torchrun_command(nproc, out, f"train.hang_timeout_s={HANG_TIMEOUT_S}", *overrides),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=variables,
        timeout=600,
    )
    return proc, time.monotonic() - start


def _flight_recorder(path: Path) -> list[dict]:
    # The bytes are PyTorch's own dump (torch.distributed.flight_recorder reads them the same way).
    return pickle.loads(path.read_bytes())["entries"]


@pytest.mark.slow
def test_one_rank_of_four_hangs_before_a_collective_and_a_shorter_stall_is_no_hang(tmp_path):
    out = tmp_path / "run"
    stall = f"hang:rank=1:group=dp:seq=2:seconds={HANG_TIMEOUT_S / 2}"
    proc, elapsed = _run(4, out, f"{stall},hang:rank=2:group=dp:seq=3", "train.steps=6")
    assert proc.returncode != 0, proc.stderr[-3000:]
    reports = out / "hang_reports"
    text = {r: (reports / f"rank{r}.txt").read_text() for r in range(4)}
    size = "2.3 MiB"  # the fp32 gradients of the 0.60M-parameter model, one bucket
    for r in (0, 1, 3):
        head = f"[watchdog rank {r}/4]"
        match = re.search(
            rf"^{re.escape(head)}   all_reduce #3 on group 'dp' \({size}; gradients of bucket 0\), "
            r"waiting ([\d.]+)s$",
            text[r],
            re.M,
        )
        assert match, text[r]
        # Not before the timeout; and in time, which is judged by events, not by a clock: every rank
        # publishes its progress (the "4 of 4" below) and PyTorch's record has the all-reduce still open
        # (not retired) when the report is written, i.e. before gloo's own timeout ended it.
        assert float(match[1]) > HANG_TIMEOUT_S
        assert f"{head}     not arrived: rank 2 (last entered on 'dp': rank 2: #2)" in text[r]
    assert (
        "[watchdog rank 2/4]   this rank has not arrived at all_reduce #3 on group 'dp' "
        f"({size}; gradients of bucket 0), where ranks 0-1,3 wait (it entered #2 on 'dp')"
    ) in text[2]
    for r in range(4):
        # Nothing was reported of the second all-reduce, where rank 1 stalled for half the timeout.
        assert "#2 on group" not in text[r] and "#2 on group" not in proc.stderr, text[r]
        assert f"[watchdog rank {r}/4] every rank (4 of 4 reported their progress):" in text[r]
        assert f"[watchdog rank {r}/4]   ranks 0-1,3: in all_reduce #3 on group 'dp' ({size}; " in text[r]
        assert f"[watchdog rank {r}/4] report: {reports / f'rank{r}.txt'}" in proc.stderr
    # Every rank wrote its whole report (above); the watchdog then ends it with 124. torchrun lists each
    # worker's code; once the first exits it SIGTERMs the rest, and a rank still unwinding its
    # broken collective (a handler restored on the way) may end by that SIGTERM a moment before its own
    # exit, its report already written: the launcher's doing, so -15 is accepted beside 124. The first
    # rank to end is always the watchdog's (124): no other code and no SIGTERM before any report.
    codes = re.findall(r"exitcode  : (-?\d+)", proc.stderr)
    assert len(codes) == 4 and set(codes) <= {"124", "-15"} and "124" in codes, proc.stderr[-3000:]

    # PyTorch's record: ranks 0, 1, 3 are inside the dp group's third all-reduce of 598,336 floats
    # (2.3 MiB), rank 2 never started it.
    blocked = {}
    for r in range(4):
        entries = _flight_recorder(reports / "flight_recorder" / f"trace_rank_{r}")
        blocked[r] = [
            (e["profiling_name"], e["collective_seq_id"], e["input_sizes"])
            for e in entries
            if not e["retired"]
        ]
        dp = {e["process_group"] for e in entries if e["input_sizes"] == [[598336]]}
        assert len(dp) == 1  # only the gradient reduction moves this many elements, on the dp group
        last = max(e["collective_seq_id"] for e in entries if e["process_group"] in dp)
        assert last == (2 if r == 2 else 3)
    waiting_in = [("gloo:all_reduce", 3, [[598336]])]
    assert blocked == {0: waiting_in, 1: waiting_in, 2: [], 3: waiting_in}
    print(f"4 ranks, hang_timeout_s={HANG_TIMEOUT_S}: job ended after {elapsed:.0f}s (start-up included)")
