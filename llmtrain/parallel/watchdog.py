"""Hang and failure diagnostics: every rank says where it waits and who has not arrived; a crash ends the job.

Each rank runs one `Watchdog`. Code that blocks on other ranks wraps the call in `watchdog.waiting(group,
op, detail)`, and every collective llmtrain issues goes through `llmtrain.parallel.comm`, which numbers it
per process group (`enter`): the n-th collective on a group is the same call on every member, so a rank
whose count on a group is below the number another rank waits in has not arrived there.

When a wait is older than `train.hang_timeout_s`, the watchdog thread raises a flag in the job's c10d
store (its own connection: the main thread is blocked) and every rank that has made no progress for half
the timeout sees the flag. Each of them publishes its progress (per group: collectives entered and
finished; its current waits) under a key of its rank, reads everybody else's, and writes a report naming
the operation it waits in (collective with sequence number, group and size; a data-loader fetch; a host
sync; a pipeline receive), the ranks that have not arrived, and one line per rank of where it is; then it
ends the process with `HANG_EXIT_CODE` so torchrun tears the job down. On NCCL the block shows at a host
sync rather than in the collective, which is why every rank's per-group counts travel with the report;
PyTorch's flight recorder is switched on as well (`flight_recorder_env`) and dumped next to the report.

`fail_fast` / `install_excepthook` print an uncaught exception's traceback tagged with the rank, then exit
at once instead of leaving the other ranks blocked in their next collective until the timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from llmtrain.faults import ENV, injected

HANG_EXIT_CODE = 124  # the convention of coreutils' timeout: "ran out of time"
FAILURE_EXIT_CODE = 1
STACK_FRAMES = 6  # innermost frames of a waiting thread shown in a hang report
GATHER_S = 5.0
"""How long a reporting rank waits for the other ranks' progress. Every blocked rank looks at the store's
flag once per poll (at most 1 s), so all live ranks publish within about a second; the rest is slack for a
loaded machine. A rank that does not publish by then is dead or stuck holding the Python GIL."""
FLIGHT_RECORDER_ENTRIES = "2000"  # PyTorch's recommended ring size: the last ~2000 collectives of each rank
SUMMARY_LINES = 32  # distinct states listed in a report's every-rank summary (the rest are counted)
HANG_REPORTS = "hang_reports"  # folder of <output_dir> that receives the reports

_installed: Watchdog | None = None


def installed() -> Watchdog | None:
    """The watchdog of this process's distributed Topology (what llmtrain.parallel.comm records into)."""
    return _installed


def process_group_timeout(hang_timeout_s: float) -> datetime.timedelta:
    """The c10d timeout of a job whose watchdog fires after `hang_timeout_s`: later than the watchdog's
    report (its poll, the progress exchange and the wait for slower readers take under 15 s), so every rank
    reports before a collective's own timeout kills it."""
    return datetime.timedelta(seconds=hang_timeout_s * 1.5 + 30)


def flight_recorder_env(
    backend: str, report_dir: Path | None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Variables that switch PyTorch's NCCL flight recorder on, to set before init_process_group.

    Only on nccl (gloo's collectives are recorded by `Watchdog`; TORCH_FR_BUFFER_SIZE set by hand records
    them in PyTorch's recorder too, dumped the same way), and never over a value the user set:
    a ring of the last 2000 collectives per rank, dumped by PyTorch itself when a collective times out
    (the watchdog dumps it too, through `dump_flight_recorder`), into `<report_dir>/flight_recorder/`
    where `python -m torch.distributed.flight_recorder.fr_trace <that folder>` reads every rank's file.
    """
    if backend != "nccl":
        return {}
    wanted = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if not any(environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        # The first name is PyTorch's since 2.7 (it warns on the second), the second the older releases'.
        wanted["TORCH_FR_BUFFER_SIZE"] = wanted["TORCH_NCCL_TRACE_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    if report_dir is not None and not any(
        environ.get(k) for k in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    ):
        # PyTorch reads one or the other name depending on its version; both get the same prefix.
        prefix = str(report_dir / "flight_recorder" / "trace_rank_")
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = prefix
    return {k: v for k, v in wanted.items() if k not in environ}


def enable_flight_recorder(backend: str, report_dir: Path | None) -> None:
    """Apply `flight_recorder_env` to this process (before init_process_group reads it)."""
    settings = flight_recorder_env(backend, report_dir)
    if "TORCH_FR_DUMP_TEMP_FILE" in settings and report_dir is not None:
        try:
            # PyTorch opens its dump file without creating the folder.
            (report_dir / "flight_recorder").mkdir(parents=True, exist_ok=True)
        except OSError:
            del settings["TORCH_FR_DUMP_TEMP_FILE"], settings["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    os.environ.update(settings)


def dump_flight_recorder(path: Path) -> bool:
    """Write PyTorch's flight-recorder trace of this process (a pickle, as fr_trace reads) to `path`.

    False when there is nothing to dump: no ring buffer configured, or a torch build without it.
    """
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    if not size.isdigit() or int(size) == 0:
        return False
    c10d = torch._C._distributed_c10d
    # NCCL builds keep a recorder of their own (CUDA events); the generic one holds the other backends.
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else ""
    name = "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace"
    dump = getattr(c10d, name, None)
    if dump is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(dump())
    return True


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"


def _rank_list(ranks: list[int]) -> str:
    """Ranks as short runs: [0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _ranks_word(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {_rank_list(ranks)}"


@dataclass
class Wait:
    """One blocking operation in progress on this rank."""

    group: str
    op: str
    detail: str
    since: float  # time.monotonic() at entry
    thread: int  # threading.get_ident() of the waiting thread
    gid: str | None = None  # c10d name of the process group, for a numbered collective
    seq: int | None = None  # the collective's number on its group (1 = the first)
    nbytes: int | None = None  # the size of this rank's input tensor
    peer: int | None = None  # the global rank a point-to-point wait expects

    def what(self) -> str:
        """The operation without its age: 'all_reduce #7 on group 'dp' (16.0 KiB; bucket 0)'."""
        text = self.op + (f" #{self.seq}" if self.seq is not None else "") + f" on group {self.group!r}"
        notes = [_size(self.nbytes)] if self.nbytes is not None else []
        notes += [self.detail] if self.detail else []
        return text + (f" ({'; '.join(notes)})" if notes else "")

    def describe(self, now: float) -> str:
        return f"{self.what()}, waiting {now - self.since:.1f}s"


@dataclass
class Collective:
    """A collective this rank issued, as `enter` numbered it."""

    op: str
    group: str  # display name ('dp', 'tp', 'world', ...)
    gid: str
    seq: int
    nbytes: int


@dataclass
class GroupProgress:
    """This rank's count of the collectives it issued on one process group."""

    name: str
    ranks: list[int]
    entered: int = 0
    finished: int = 0  # waited for (on NCCL: handed to the stream, not necessarily complete on the device)
    last_op: str = ""  # the last collective entered
    last_nbytes: int = 0  # its size


class ProgressExchange:
    """The hang flag and every rank's progress, in the job's c10d store under keys of this launch."""

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.world_size = world_size
        # The store may outlive a restart attempt (torchrun's agent keeps it): keys carry the attempt.
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"llmtrain/watchdog/{run}/{attempt}/"

    @classmethod
    def of_default_group(cls, world_size: int) -> ProgressExchange | None:
        """An exchange over a new connection to the default process group's store, None outside a job."""
        if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        # A clone: the main thread uses the original connection and may be blocked on it.
        return cls(dist.distributed_c10d._get_default_store().clone(), world_size)

    def raise_flag(self, text: str) -> None:
        self.store.set(self.prefix + "hang", text)

    def flag(self) -> str | None:
        if not self.store.check([self.prefix + "hang"]):
            return None
        return self.store.get(self.prefix + "hang").decode()

    def publish(self, rank: int, progress: dict[str, Any]) -> None:
        self.store.set(f"{self.prefix}progress/{rank}", json.dumps(progress))
        self.store.add(self.prefix + "published", 1)

    def gather(self, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every rank's progress published within `timeout_s` (all of them, normally)."""
        deadline = time.monotonic() + timeout_s
        while self.store.add(self.prefix + "published", 0) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
        keys = {r: f"{self.prefix}progress/{r}" for r in range(self.world_size)}
        present = list(keys)
        if self.store.add(self.prefix + "published", 0) < self.world_size:
            present = [r for r, key in keys.items() if self.store.check([key])]
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        return {r: json.loads(v) for r, v in zip(present, values, strict=True)}

    def finish(self, timeout_s: float) -> None:
        """Count this rank's report as written and wait (bounded) until every rank that published has read:
        the store may live in one of these processes (rank 0 without torchrun), which must not go first."""
        deadline = time.monotonic() + timeout_s
        done = self.store.add(self.prefix + "reported", 1)
        while done < self.store.add(self.prefix + "published", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
            done = self.store.add(self.prefix + "reported", 0)


class Watchdog:
    """Per-process record of what this rank waits on and the collectives it issued, with a thread that
    reports and exits when the job stops making progress.

    `timeout_s` is train.hang_timeout_s; `report_dir` receives rank<r>.txt and the flight-recorder dump
    (None: stderr only); `on_hang(report)` replaces the default (print to `stream`, write the files, then
    os._exit(HANG_EXIT_CODE)) for tests and for callers that want to abort differently.
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int = 0,
        world_size: int = 1,
        *,
        report_dir: Path | None = None,
        stream: TextIO | None = None,
        on_hang: Callable[[str], None] | None = None,
        poll_s: float | None = None,
        exchange: ProgressExchange | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"train.hang_timeout_s must be positive; got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self.report_dir = report_dir
        self.stream = stream
        self.on_hang = on_hang if on_hang is not None else self._report_and_exit
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.exchange = exchange
        self.step: int | None = None  # the training step in progress, when the trainer says (`at_step`)
        self._faults = bool(os.environ.get(ENV))  # read once: `enter` runs on every collective
        self._waits: dict[int, Wait] = {}  # id(wait) -> wait; several threads may wait at once
        self._groups: dict[str, GroupProgress] = {}  # c10d group name -> this rank's count on it
        self._group_ids: dict[Any, str] = {}  # process group object -> c10d group name
        self._last_progress = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.hang_found = threading.Event()
        """Set once this rank reports a hang: the process ends through the report, with HANG_EXIT_CODE."""
        self._thread: threading.Thread | None = None

    def install(self) -> Watchdog:
        """Make this the watchdog that llmtrain.parallel.comm records collectives into (one per process)."""
        global _installed
        _installed = self
        return self

    def start(self) -> Watchdog:
        """Start the monitoring thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            if self.exchange is None:
                try:
                    self.exchange = ProgressExchange.of_default_group(self.world_size)
                except Exception as exc:  # still worth watching: a report of this rank alone
                    print(
                        f"[watchdog rank {self.rank}/{self.world_size}] the job's store is out of reach "
                        f"({exc}); a hang report will show this rank only",
                        file=self.stream if self.stream is not None else sys.stderr,
                        flush=True,
                    )
            self._thread = threading.Thread(target=self._run, name=f"watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the monitoring thread; waits are still recorded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop.clear()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def at_step(self, step: int) -> None:
        """Note that training step `step` begins (shown in reports; the `hang` fault can match it)."""
        self.step = step
        self._last_progress = time.monotonic()

    def name_group(self, group: Any, name: str) -> None:
        """Call `group` by `name` ('dp', 'tp', ...) in reports; the same name on every member."""
        gid = self._group_id(group)
        with self._lock:
            self._groups[gid].name = name

    def _group_id(self, group: Any) -> str:
        pg = group if group is not None else dist.group.WORLD
        gid = self._group_ids.get(pg)
        if gid is None:
            gid = pg.group_name
            name = "world" if pg is dist.group.WORLD else f"c10d group {gid}"
            progress = GroupProgress(name, dist.get_process_group_ranks(pg))
            with self._lock:
                self._group_ids[pg] = gid
                self._groups.setdefault(gid, progress)
        return gid

    def enter(self, group: Any, op: str, nbytes: int) -> Collective:
        """Number a collective about to be issued on `group` (None: the default group)."""
        gid = self._group_id(group)
        progress = self._groups[gid]
        seq = progress.entered + 1
        if self._faults:
            self._inject_hang(progress.name, op, seq)
        # Plain assignments (atomic in Python), no lock: only this thread writes them, on every collective.
        progress.last_op, progress.last_nbytes, progress.entered = op, nbytes, seq
        self._last_progress = time.monotonic()
        return Collective(op, progress.name, gid, seq, nbytes)

    def _inject_hang(self, group: str, op: str, seq: int) -> None:
        fault = injected("hang", rank=self.rank, step=self.step, group=group, op=op, seq=seq)
        if fault is not None:
            # Stall before the collective, as a rank stuck in its own code would: it never arrives.
            seconds = float(fault.params.get("seconds", "inf"))
            threading.Event().wait(None if seconds == float("inf") else seconds)

    def finished(self, collective: Collective) -> None:
        """`collective` was waited for."""
        progress = self._groups[collective.gid]
        progress.finished = max(progress.finished, collective.seq)
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def waiting(
        self,
        group: str,
        op: str,
        detail: str = "",
        *,
        collective: Collective | None = None,
        peer: int | None = None,
    ) -> Iterator[None]:
        """Mark the body as blocked on `op` over process group `group`; `detail` says why (e.g. 'F mb=3').

        `collective` (from `enter`) adds its sequence number and size; `peer` names the global rank a
        point-to-point wait expects.
        """
        wait = Wait(group, op, detail, time.monotonic(), threading.get_ident(), peer=peer)
        if collective is not None:
            wait.gid, wait.seq, wait.nbytes = collective.gid, collective.seq, collective.nbytes
        with self._lock:
            self._waits[id(wait)] = wait
            self._last_progress = wait.since
        try:
            yield
        finally:
            with self._lock:
                del self._waits[id(wait)]
            if collective is not None:
                self.finished(collective)
            else:
                self._last_progress = time.monotonic()

    def current(self) -> list[Wait]:
        """Waits in progress, oldest first."""
        with self._lock:
            return sorted(self._waits.values(), key=lambda w: w.since)

    def progress(self, now: float | None = None) -> dict[str, Any]:
        """What this rank publishes to the others on a hang (JSON-able)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            groups = {gid: asdict(g) for gid, g in self._groups.items()}
            idle = now - self._last_progress
        waits = [
            {**{k: v for k, v in asdict(w).items() if k not in ("since", "thread")}, "age": now - w.since}
            for w in self.current()
        ]
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "idle": idle,
            "waits": waits,
            "groups": groups,
        }

    def report(
        self, now: float | None = None, peers: dict[int, dict[str, Any]] | None = None, cause: str = ""
    ) -> str:
        """What this rank waits on, each wait with the Python stack of the thread that waits, and with
        `peers` (every rank's `progress`) the ranks that have not arrived and where each rank is."""
        now = time.monotonic() if now is None else now
        head = f"[watchdog rank {self.rank}/{self.world_size}]"
        mine = self.progress(now)
        waits = self.current()
        if not waits and not cause:
            return f"{head} not waiting on any collective"
        step = f" at step {self.step}" if self.step is not None else ""
        lines = [f"{head} hang{step}: {cause or 'a wait exceeded train.hang_timeout_s'}"]
        frames = sys._current_frames()
        peers = peers or {}
        if waits:
            lines.append(f"{head} this rank waits in:")
        else:
            idle = mine["idle"]
            lines.append(f"{head} this rank is in no recorded wait (idle {idle:.1f}s); its main thread:")
            lines.extend(_stack(frames.get(threading.main_thread().ident), f"{head}     "))
        for wait in waits:
            lines.append(f"{head}   {wait.describe(now)}")
            lines.extend(f"{head}     {line}" for line in _arrivals(wait, mine, peers))
            lines.extend(_stack(frames.get(wait.thread), f"{head}     "))
        if not waits and peers:
            lines.extend(f"{head}   {line}" for line in _lagging(mine, peers))
        if peers:
            lines.append(f"{head} every rank ({len(peers)} of {self.world_size} reported their progress):")
            lines.extend(f"{head}   {line}" for line in _summary(peers, self.world_size))
        return "\n".join(lines)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            waits = self.current()
            if waits and now - waits[0].since > self.timeout_s:
                cause = (
                    f"rank {self.rank} waited {now - waits[0].since:.1f}s in {waits[0].what()}, over "
                    f"train.hang_timeout_s={self.timeout_s:g}"
                )
                self._hang(cause, raise_flag=True)
                return
            if self.exchange is not None and now - self._last_progress > self.timeout_s / 2:
                # Stalled for a while: if another rank found a hang, this rank is part of it.
                with contextlib.suppress(Exception):  # a store gone at the job's end is no hang
                    flag = self.exchange.flag()
                    if flag is not None:
                        self._hang(flag, raise_flag=False)
                        return

    def _hang(self, cause: str, raise_flag: bool) -> None:
        self.hang_found.set()
        if self.on_hang == self._report_and_exit:
            # This rank reports and exits 124 from here; the first rank to exit makes the launcher
            # (torchrun, mp.spawn) SIGTERM the others, which would cut their reports short.
            _ignore_sigterm()
        peers: dict[int, dict[str, Any]] = {}
        if self.exchange is not None:
            try:
                if raise_flag:
                    self.exchange.raise_flag(cause)
                published = self.progress()
                for group in published["groups"].values():
                    # Each reader knows its own groups' members: the job's store carries no W x W ranks.
                    del group["ranks"]
                self.exchange.publish(self.rank, published)
                peers = self.exchange.gather(GATHER_S)
            except Exception as exc:  # the report without the others still says where this rank is
                cause += f" (the other ranks' progress is unavailable: {exc})"
        self.on_hang(self.report(peers=peers, cause=cause))

    def save_report(self, report: str) -> str:
        """Write `report` to report_dir/rank<r>.txt (with the flight recorder's dump beside it, when one
        is configured); return it with where it went appended."""
        if self.report_dir is None:
            return report
        head = f"[watchdog rank {self.rank}/{self.world_size}]"
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = self.report_dir / f"rank{self.rank}.txt"
            path.write_text(report + "\n")
            trace = self.report_dir / "flight_recorder" / f"trace_rank_{self.rank}"
            if dump_flight_recorder(trace):
                report += f"\n{head} flight recorder: {trace}"
            return report + f"\n{head} report: {path}"
        except OSError as err:
            return report + f"\n{head} report not saved: {err}"

    def _report_and_exit(self, report: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(self.save_report(report), file=stream, flush=True)
        if self.exchange is not None:
            with contextlib.suppress(Exception):
                self.exchange.finish(GATHER_S)
        # os._exit, not sys.exit: the main thread is stuck inside a C++ collective and never returns
        # to Python, so only ending the process here frees the job (torchrun then stops the others).
        os._exit(HANG_EXIT_CODE)


def _ignore_sigterm() -> None:
    """Ignore SIGTERM process-wide from a thread that is not the main one (Python's signal.signal may only
    be called from the main thread, which is stuck in a collective): libc's signal() with SIG_IGN."""
    with contextlib.suppress(OSError, AttributeError):  # no libc (not Linux/macOS): the report may be cut
        ctypes.CDLL(None).signal(signal.SIGTERM, ctypes.c_void_p(1))  # 1 is SIG_IGN


def _stack(frame: Any, indent: str) -> list[str]:
    if frame is None:
        return []
    # The innermost frames say where it blocks; the launcher's frames above them are noise.
    stack = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
    return [indent + line for line in stack.splitlines()]


def _arrivals(wait: Wait, mine: dict[str, Any], peers: dict[int, dict[str, Any]]) -> list[str]:
    """Which ranks `wait` still expects: the members below its number, or the peer it receives from.

    A wait without a number (a host sync, or a collective issued around llmtrain.parallel.comm) is
    compared with this rank's own count on the group of that name.
    """
    if not peers:
        return []
    if wait.peer is not None:
        peer = peers.get(wait.peer)
        where = _where(peer) if peer is not None else SILENT
        return [f"expects rank {wait.peer}, which is {where}"]
    gid = wait.gid if wait.gid is not None else _gid_named(mine, wait.group)
    if gid is None:
        return []
    group = mine["groups"][gid]
    seq = wait.seq if wait.seq is not None else group["entered"]
    if seq == 0:  # no collective of this rank's went through llmtrain.parallel.comm on that group
        return []
    behind = [r for r in group["ranks"] if r in peers and _entered(peers[r], gid) < seq]
    silent = [r for r in group["ranks"] if r not in peers]
    lines = []
    if behind:
        counts = ", ".join(f"rank {r}: #{_entered(peers[r], gid)}" for r in behind)
        lines.append(f"not arrived: {_ranks_word(behind)} (last entered on {group['name']!r}: {counts})")
    if silent:
        lines.append(f"{_ranks_word(silent)}: {SILENT}")
    if not lines:
        lines.append(f"every rank of group {group['name']!r} entered its collective #{seq}")
    return lines


SILENT = "no progress reported (dead, or stuck holding the Python GIL)"


def _entered(progress: dict[str, Any], gid: str) -> int:
    return progress["groups"].get(gid, {}).get("entered", 0)


def _gid_named(progress: dict[str, Any], name: str) -> str | None:
    return next((gid for gid, g in progress["groups"].items() if g["name"] == name), None)


def _lagging(mine: dict[str, Any], peers: dict[int, dict[str, Any]]) -> list[str]:
    """For a rank in no wait: the collectives others wait in that it has not entered."""
    lines = []
    for gid, group in mine["groups"].items():
        ahead: dict[str, list[int]] = {}
        for r in group["ranks"]:
            if r == mine["rank"] or r not in peers:
                continue
            theirs = _entered(peers[r], gid)
            if theirs > group["entered"]:
                waits = [w for w in peers[r]["waits"] if w.get("gid") == gid]
                what = _wait_text(waits[0]) if waits else f"#{theirs} on group {group['name']!r}"
                ahead.setdefault(what, []).append(r)
        for what, ranks in ahead.items():
            lines.append(
                f"this rank has not arrived at {what}, where {_ranks_word(ranks)} wait "
                f"(it entered #{group['entered']} on {group['name']!r})"
            )
    return lines


def _wait_text(wait: dict[str, Any]) -> str:
    fields = {k: wait.get(k) for k in ("group", "op", "detail", "gid", "seq", "nbytes", "peer")}
    return Wait(since=0.0, thread=0, **fields).what()


def _where(progress: dict[str, Any]) -> str:
    if progress["waits"]:
        return "in " + "; ".join(_wait_text(w) for w in progress["waits"])
    last = [
        f"{g['last_op']} #{g['entered']} ({_size(g['last_nbytes'])}) on {g['name']!r}"
        for g in progress["groups"].values()
        if g["last_op"]
    ]
    return "in no recorded wait" + (f"; last entered {', '.join(last)}" if last else "")


def _summary(peers: dict[int, dict[str, Any]], world_size: int) -> list[str]:
    """One line per distinct state, with the ranks in it."""
    states: dict[str, list[int]] = {}
    for r in range(world_size):
        where = _where(peers[r]) if r in peers else SILENT
        states.setdefault(where, []).append(r)
    lines = [f"{_ranks_word(ranks)}: {where}" for where, ranks in states.items()]
    if len(lines) > SUMMARY_LINES:
        rest = sum(len(ranks) for ranks in list(states.values())[SUMMARY_LINES:])
        lines = lines[:SUMMARY_LINES] + [f"... and {rest} more ranks in other states"]
    return lines


def format_failure(rank: int, exc: BaseException) -> str:
    """An exception's traceback with every line tagged by the rank, so it stands out in merged logs."""
    head = f"[rank {rank}]"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    return "\n".join([f"{head} failed; ending the job:"] + [f"{head} {line}" for line in text.splitlines()])


def _die(rank: int, exc: BaseException, stream: TextIO | None) -> None:
    watchdog = installed()
    if watchdog is not None and watchdog.hang_found.is_set():
        # A peer that ended after its hang report breaks this rank's collective: a consequence, not the
        # cause. The watchdog thread is writing this rank's report and ends the process when it is done.
        print(f"[rank {rank}] {type(exc).__name__} after the hang reported above: {exc}", file=sys.stderr)
        _ignore_sigterm()  # again: unwinding to here may have restored a handler (training's StopRequest)
        time.sleep(2 * GATHER_S + 5)
        os._exit(HANG_EXIT_CODE)
    print(format_failure(rank, exc), file=stream if stream is not None else sys.stderr, flush=True)
    # Skip interpreter shutdown: destroying process groups or joining threads can block on peers
    # that are themselves stuck waiting for this rank.
    os._exit(FAILURE_EXIT_CODE)


@contextlib.contextmanager
def fail_fast(rank: int, stream: TextIO | None = None) -> Iterator[None]:
    """Run the body; on any exception print it tagged with `rank` and exit the process at once.

    SystemExit passes through (a deliberate exit, such as a config error's code, is not a crash).
    """
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # KeyboardInterrupt too: the peers would otherwise hang
        _die(rank, exc, stream)


def install_excepthook(rank: int, stream: TextIO | None = None) -> None:
    """Make an uncaught exception in any thread of this process end the process like `fail_fast`."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        _die(rank, exc, stream)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            _die(rank, args.exc_value, stream)

    sys.excepthook = hook
    threading.excepthook = thread_hook
