"""Disk caches that several ranks may build at once: one builder under a lock, atomic publication."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts, used to name cache entries."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_identity(path: str | os.PathLike) -> list:
    """What identifies a file's version cheaply: resolved path, size and modification time."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an inter-process lock named after `path` (a sibling `.lock` file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def build_dir_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Return `final`, building it first with `build(tmp_dir)` if absent; concurrent callers build it once.

    The directory appears atomically (rename of a finished temporary directory), so a reader never sees
    a half-written cache even if the builder dies.
    """
    if final.is_dir():
        return final
    with locked(final):
        if final.is_dir():  # another rank built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        try:
            build(tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
