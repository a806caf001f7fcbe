"""Run the points of a sweep as subprocesses, each in its own directory, resumable and failure-tolerant.

Each run directory holds stdout.log, stderr.log, the run's own outputs (metrics.jsonl, ...) and
sweep_run.json, whose status "done" is the marker that lets a re-run of the sweep skip it. A point run
again (it failed, or the sweep was stopped) appends to its logs under a header naming the attempt, so
earlier attempts' output is kept; the record says which attempt it describes and keeps the earlier ones.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from llmtrain.config import ConfigError, load, parse_override
from llmtrain.config.loader import resolve_config
from llmtrain.sweep.errors import SweepError
from llmtrain.sweep.grid import SweepPoint
from llmtrain.training.metrics_file import METRICS_FILE, latest_per_step, read_rows, row_kind

RECORD = "sweep_run.json"
STDOUT_LOG, STDERR_LOG = "stdout.log", "stderr.log"
DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "pretrain.py"


@dataclass
class RunResult:
    """Outcome of one point: status is done (this time or an earlier sweep) or failed."""

    name: str
    overrides: dict[str, str]
    status: str
    returncode: int | None = None
    error: str | None = None  # one line: exit code and the last line of stderr
    stderr_tail: str = ""
    duration_s: float = 0.0
    reused: bool = False  # finished by an earlier invocation of the sweep, not run again
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The run's metrics.jsonl rows, the latest per step and kind (a resumed run may have redone steps)."""
    attempt: int = 1


def run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics as its readers must take them: the row written last for each step and kind."""
    return latest_per_step(read_rows(run_dir / METRICS_FILE))


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Let `write` fill a temporary file beside `path`, then move it over `path` in one step: a reader (or a
    crash) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    write(tmp)
    os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _tail(path: Path, start: int = 0, lines: int = 20) -> str:
    """The last lines of `path` from byte offset `start` (this attempt's part of an appended log)."""
    if not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(start)
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def final_step(config: Path, point: SweepPoint, extra: list[str]) -> int | None:
    """train.steps of the point's job, or None when its config does not load (the run itself says why)."""
    try:
        return load(config, [*point.args, *extra]).train.steps
    except ConfigError:
        return None


def check_finished(metrics: list[dict[str, Any]], expected_step: int | None) -> str | None:
    """Why a run that exited 0 does not count as done (its metrics do not end at train.steps); else None.

    A run can exit 0 without training: the run tool says "nothing to do" when its output_dir already
    reached train.steps; then the rows of the earlier launch are the run's own and count. Rows that stop
    short of train.steps, or run past it, belong to some other run and would show stale numbers.
    """
    steps = [int(row["step"]) for row in metrics if row_kind(row) == "train"]
    if not steps:
        return f"exited 0 but wrote no training rows to {METRICS_FILE}"
    if expected_step is not None and steps[-1] != expected_step:
        return f"exited 0 but {METRICS_FILE} ends at step {steps[-1]}, not at train.steps={expected_step}"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_command(
    config: Path, run_dir: Path, point: SweepPoint, extra: list[str], launcher: str | None, script: Path
) -> list[str]:
    """`python SCRIPT --config BASE output_dir=RUN_DIR overrides... extra...`; a launcher replaces `python`.

    (torchrun runs the script itself: `torchrun --nproc_per_node 4 tools/pretrain.py ...`.)
    """
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    return [*prefix, str(script), "--config", str(config), f"output_dir={run_dir}", *point.args, *extra]


class _Sweep:
    """State shared by the worker threads of one sweep invocation."""

    def __init__(
        self,
        config: Path,
        output: Path,
        extra: list[str],
        launcher: str | None,
        script: Path,
        parallel: int,
        timeout_s: float | None,
        total: int,
        stream: TextIO,
    ) -> None:
        self.config, self.output, self.extra = config, output, extra
        self.launcher, self.script, self.parallel, self.timeout_s = launcher, script, parallel, timeout_s
        self.total, self.stream, self.finished = total, stream, 0
        self._lock = threading.Lock()

    def say(self, point: SweepPoint, text: str) -> None:
        with self._lock:
            self.finished += 1
            print(f"[{self.finished}/{self.total}] {point.name}: {text}", file=self.stream, flush=True)

    def run(self, point: SweepPoint) -> RunResult:
        run_dir = self.output / point.name
        record_path = run_dir / RECORD
        identity = {"config": str(self.config), "overrides": point.overrides, "extra": self.extra}
        earlier = _read_record(record_path)
        if earlier.get("status") == "done" and all(earlier.get(k) == v for k, v in identity.items()):
            self.say(point, "already finished, skipped")
            return RunResult(
                point.name,
                point.overrides,
                "done",
                earlier.get("returncode"),
                duration_s=earlier.get("duration_s", 0.0),
                reused=True,
                metrics=run_metrics(run_dir),
                attempt=earlier.get("attempt", 1),
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        # A record without an attempt number comes from before attempts were counted: that was attempt 1.
        attempt = earlier.get("attempt", 1 if earlier or (run_dir / STDERR_LOG).exists() else 0) + 1
        command = build_command(self.config, run_dir, point, self.extra, self.launcher, self.script)
        record = {
            **identity,
            "command": command,
            "status": "running",
            "attempt": attempt,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "earlier_attempts": _earlier_attempts(earlier),
        }
        write_atomic(record_path, json.dumps(record, indent=1))
        env = dict(os.environ)
        if self.launcher and self.parallel > 1:
            # Concurrent torchrun jobs would all rendezvous on the default port 29500.
            env["PET_MASTER_PORT"] = env["MASTER_PORT"] = str(_free_port())
        expected_step = final_step(self.config, point, self.extra)
        header = f"===== sweep attempt {attempt}, {record['started']}: {shlex.join(command)}\n"
        start = time.perf_counter()
        with open(run_dir / STDOUT_LOG, "a") as out, open(run_dir / STDERR_LOG, "a") as err:
            for log in (out, err):  # appended, never truncated: earlier attempts' output stays above
                log.write(header)
                log.flush()
            stderr_start = os.fstat(err.fileno()).st_size  # where this attempt's stderr begins
            try:
                returncode = subprocess.run(
                    command, stdout=out, stderr=err, env=env, timeout=self.timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                returncode = None
        duration = time.perf_counter() - start
        metrics = run_metrics(run_dir)
        tail = _tail(run_dir / STDERR_LOG, stderr_start)
        if returncode is None:
            error = f"timed out after {self.timeout_s:g}s"
        elif returncode != 0:
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "no output on stderr")
            error = f"exit {returncode}: {last.strip()}"
        else:
            error = check_finished(metrics, expected_step)
        status = "failed" if error else "done"
        record.update(
            status=status, returncode=returncode, error=error, stderr_tail=tail, duration_s=duration
        )
        write_atomic(record_path, json.dumps(record, indent=1))
        note = f" ({error})" if error else ""
        self.say(
            point, f"{status} in {duration:.1f}s" + (f", attempt {attempt}" if attempt > 1 else "") + note
        )
        return RunResult(
            point.name,
            point.overrides,
            status,
            returncode,
            error,
            tail,
            duration,
            metrics=metrics,
            attempt=attempt,
        )


def _earlier_attempts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts before the one `record` describes, then that one in brief (what ran, how it ended)."""
    if not record:
        return []
    keys = ("attempt", "started", "overrides", "extra", "status", "returncode", "error", "duration_s")
    return [*record.get("earlier_attempts", []), {k: record[k] for k in keys if k in record}]


def check_fixed_overrides(points: list[SweepPoint], extra: list[str]) -> None:
    """The fixed overrides given beside the grid: key=value each, no key also a grid axis, no output_dir."""
    fixed = []
    for item in extra:
        try:
            fixed.append(parse_override(item)[0])
        except ConfigError as err:
            raise SweepError(f"fixed override: {err}") from None
    swept = {key for point in points for key in point.overrides}
    for key in [*fixed, *swept]:
        if key == "output_dir":
            raise SweepError("output_dir is set by the sweep (OUTPUT/<run name>); use --output instead")
    both = sorted(swept.intersection(fixed))
    if both:
        raise SweepError(f"{both[0]} is both swept and fixed; drop the fixed {both[0]}=... or the axis")


def run_sweep(
    config: str | Path,
    points: list[SweepPoint],
    output: str | Path,
    *,
    extra: list[str] | tuple[str, ...] = (),
    launcher: str | None = None,
    parallel: int = 1,
    script: str | Path = DEFAULT_SCRIPT,
    timeout_s: float | None = None,
    stream: TextIO | None = None,
) -> list[RunResult]:
    """Run every point (up to `parallel` at once), skipping those an earlier sweep finished; never raises
    for a failed run. `extra` are the fixed `key.path=value` overrides given to every run. Results come
    back in the order of `points`."""
    try:
        config = resolve_config(config).resolve()  # a path, or a shipped config's name
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    script, output = Path(script).resolve(), Path(output).resolve()
    if not script.is_file():
        raise SweepError(f"training script {script} does not exist; pass an existing file to --script")
    if parallel < 1:
        raise SweepError(f"--parallel must be at least 1; got {parallel}")
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f"sweep run names must be unique; got {names}")
    check_fixed_overrides(points, list(extra))
    output.mkdir(parents=True, exist_ok=True)
    sweep = _Sweep(
        config,
        output,
        list(extra),
        launcher,
        script,
        parallel,
        timeout_s,
        len(points),
        stream if stream is not None else sys.stdout,
    )
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(sweep.run, points))
