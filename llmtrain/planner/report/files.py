"""Plans as files: the winning config as YAML, and the atomic writes every planner tool uses.

Files are written whole or not at all (a temporary file beside the target, then one rename), and an existing
file is replaced only when the caller says so: a config the user edited is never silently overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtrain.config import ConfigError, to_dict, validate
from llmtrain.config.loader import dump_yaml
from llmtrain.config.schema import JobConfig
from llmtrain.planner.cost.layout import with_layout
from llmtrain.planner.cost.model import Estimate


def check_new_file(path: str | Path, overwrite: bool = False) -> Path:
    """`path` as a Path, after checking that writing it replaces nothing unless `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; choose another path, or pass --overwrite to replace it")
    return path


def write_file(path: str | Path, write: Callable[[Path], Any], overwrite: bool = False) -> None:
    """Create `path` by `write(temporary path)` and one rename (missing folders are made), so readers never
    see half a file; an existing file is replaced only with `overwrite`."""
    path = check_new_file(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder (the rename stays on one file system) and same suffix (matplotlib picks the format by it).
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_yaml(data: Any, path: str | Path, overwrite: bool = False) -> None:
    """Write `data` as YAML that llmtrain's loaders read back unchanged (see write_file)."""
    text = dump_yaml(data)
    write_file(path, lambda tmp: tmp.write_text(text), overwrite)


def write_config(
    job: JobConfig,
    estimate: Estimate,
    path: str | Path,
    global_batch: int | None = None,
    overwrite: bool = False,
    dp_micro_batches: Sequence[int] = (),
) -> JobConfig:
    """Write `job` running the estimate's layout (and `dp_micro_batches`, a heterogeneous plan's
    micro-batches per replica) as a YAML that llmtrain.config.load accepts."""
    best = with_layout(job, estimate.layout, global_batch)
    best = replace(best, train=replace(best.train, dp_micro_batches=list(dp_micro_batches)))
    validate(best)
    write_yaml(to_dict(best), path, overwrite)
    return best
