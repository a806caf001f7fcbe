"""Disk caches that several ranks may build at once: one builder under a lock, atomic publication."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from llmtrain.data.progress import is_local_leader, say, tag

WAIT_NOTICE_S = 1.0
"""A wait on another builder longer than this is announced (shorter ones, like sample indices, are not)."""


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts, used to name cache entries."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_identity(path: str | os.PathLike) -> list:
    """What identifies a file's version cheaply: resolved path, size and modification time."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def _holder_file(path: Path) -> Path:
    return Path(str(path) + ".holder")


def _holder() -> str:
    rank = os.environ.get("RANK")
    return f"pid {os.getpid()} on {socket.gethostname()}" + (f", rank {rank}" if rank is not None else "")


@contextlib.contextmanager
def locked(path: Path, what: str | None = None) -> Iterator[None]:
    """Hold an inter-process lock named after `path` (a sibling `.lock` file).

    With `what` (e.g. "the stdlib corpus"), a process that waits longer than WAIT_NOTICE_S says once what it
    waits for and on whom, if it speaks for its machine (local rank 0): the other ranks wait silently, so
    a job prints one such line, not one per rank.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path) + ".lock")
    try:
        lock.acquire(timeout=WAIT_NOTICE_S if what else -1)
    except Timeout:
        if is_local_leader():
            try:
                holder = _holder_file(path).read_text().strip() or "another process"
            except OSError:
                holder = "another process"
            say(f"{tag('data')} waiting for {holder} to finish preparing {what} ({path})")
        lock.acquire()
    try:
        if what:
            _holder_file(path).write_text(_holder())
        yield
    finally:
        if what:
            _holder_file(path).unlink(missing_ok=True)
        lock.release()


def build_dir_once(final: Path, build: Callable[[Path], None], what: str | None = None) -> Path:
    """Return `final`, building it first with `build(tmp_dir)` if absent; concurrent callers build it once.

    The directory appears atomically (rename of a finished temporary directory), so a reader never sees
    a half-written cache even if the builder dies. Temporary directories that a killed builder left (under
    the lock no live builder of `final` can own one) are removed before building. `what` names the cache
    in the line a waiting process prints (see `locked`).
    """
    if final.is_dir():
        return final
    with locked(final, what):
        if final.is_dir():  # another rank built it while we waited
            return final
        for stale in final.parent.glob(final.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        try:
            build(tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
