"""Run the points of a sweep as subprocesses, each in its own directory, resumable and failure-tolerant.

Each run directory holds stdout.log, stderr.log, the run's own outputs (metrics.jsonl, ...) and
sweep_run.json, whose status "done" is the marker that lets a re-run of the sweep skip it.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from llmtrain.sweep.grid import SweepPoint

RECORD = "sweep_run.json"
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


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The entries of a run's metrics.jsonl (an unfinished last line is ignored)."""
    path = run_dir / "metrics.jsonl"
    entries = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries


def _tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


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
        if record_path.exists():
            record = json.loads(record_path.read_text())
            if record.get("status") == "done" and all(record.get(k) == v for k, v in identity.items()):
                self.say(point, "already finished, skipped")
                return RunResult(
                    point.name,
                    point.overrides,
                    "done",
                    record.get("returncode"),
                    duration_s=record.get("duration_s", 0.0),
                    reused=True,
                    metrics=read_metrics(run_dir),
                )
        run_dir.mkdir(parents=True, exist_ok=True)
        command = build_command(self.config, run_dir, point, self.extra, self.launcher, self.script)
        record = {**identity, "command": command, "status": "running"}
        record_path.write_text(json.dumps(record, indent=1))
        env = dict(os.environ)
        if self.launcher and self.parallel > 1:
            # Concurrent torchrun jobs would all rendezvous on the default port 29500.
            env["PET_MASTER_PORT"] = env["MASTER_PORT"] = str(_free_port())
        start = time.perf_counter()
        with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
            try:
                returncode = subprocess.run(
                    command, stdout=out, stderr=err, env=env, timeout=self.timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                returncode = None
        duration = time.perf_counter() - start
        metrics = read_metrics(run_dir)
        tail = _tail(run_dir / "stderr.log")
        error = None
        if returncode is None:
            error = f"timed out after {self.timeout_s:g}s"
        elif returncode != 0:
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "no output on stderr")
            error = f"exit {returncode}: {last.strip()}"
        elif not any("loss" in entry for entry in metrics):
            error = "exited 0 but wrote no training entries to metrics.jsonl"
        status = "failed" if error else "done"
        record.update(
            status=status, returncode=returncode, error=error, stderr_tail=tail, duration_s=duration
        )
        record_path.write_text(json.dumps(record, indent=1))
        self.say(point, f"{status} in {duration:.1f}s" + (f" ({error})" if error else ""))
        return RunResult(
            point.name, point.overrides, status, returncode, error, tail, duration, metrics=metrics
        )


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
    for a failed run. Results come back in the order of `points`."""
    config, script, output = Path(config).resolve(), Path(script).resolve(), Path(output).resolve()
    if not config.is_file():
        raise ValueError(f"--config {config} does not exist")
    if not script.is_file():
        raise ValueError(f"training script {script} does not exist")
    if parallel < 1:
        raise ValueError(f"--parallel must be at least 1; got {parallel}")
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep run names must be unique; got {names}")
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
