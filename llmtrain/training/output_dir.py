"""A run's output directory across launches: what earlier launches left, and what this launch starts from.

A run writes these into output_dir (`RUN_ENTRIES`): config.yaml (its first launch's validated config),
config.segment<N>.yaml (each later launch's), launches.jsonl (one row per launch), metrics.jsonl
(append-only, rows tagged with the launch's segment), checkpoints/, tensorboard/, profile/, wandb/ (the W&B
run's id and files, llmtrain.training.wandb_run) and hf/ (checkpoint.export_hf). A launch:
- into a directory holding none of them starts fresh as segment 0 (from checkpoint.load, if set: a checkpoint,
  or a Hugging Face model directory converted for this run by llmtrain.training.hf_io);
- into one holding a run resumes from that run's latest checkpoint as the next segment (or starts again
  at step 0 when no launch got as far as a checkpoint); its own checkpoint wins over checkpoint.load;
  checkpoint.resume=false refuses instead, and checkpoint.archive_existing=true moves the earlier run to
  archive/<timestamp>/ and starts fresh;
- restarted by torchrun (an elastic restart of the same job) always continues its own run.
`plan_launch` only reads; `commit` writes, on rank 0, once every check passed and the starting checkpoint
loaded, so a refused or failed launch leaves the directory as it found it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.directory import last_good_checkpoint, read_meta, resolve
from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.config import ConfigError, JobConfig, dump
from llmtrain.launch_env import launch_attempt
from llmtrain.training.hf_io import check_model_dir, is_model_dir
from llmtrain.training.metrics_file import METRICS_FILE, next_segment

CONFIG = "config.yaml"
LAUNCHES = "launches.jsonl"
ARCHIVE = "archive"
RUN_ENTRIES = (CONFIG, LAUNCHES, METRICS_FILE, "checkpoints", "tensorboard", "profile", "wandb", "hf")
_SEGMENT_CONFIG = re.compile(r"config\.segment(\d+)\.yaml")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What this launch of a run starts from and where it writes; the same on every rank."""

    output_dir: str
    segment: int
    """0 for a run's first launch, one more for each later launch into the same output_dir."""
    start_step: int
    resume_from: str | None
    """The checkpoint this launch loads (output_dir's own latest, or checkpoint.load); None: step 0."""
    own_checkpoint: bool
    """resume_from is output_dir's own checkpoint (a resumed run), not checkpoint.load."""
    earlier_run: str | None
    """A one-line description of the run output_dir held before this launch; None for a fresh directory."""
    archive_to: str | None
    """Where commit moves that earlier run (checkpoint.archive_existing)."""
    config_file: str
    """The file commit writes this launch's validated config to."""
    total_steps: int
    skipped: tuple[str, ...] = ()
    """Newer saves of the run it did not resume from, each with why (interrupted, failing its checksums)."""
    model_dir: bool = False
    """resume_from is checkpoint.load's model directory (Hugging Face or llmtrain): converted, step 0."""

    @property
    def nothing_to_do(self) -> bool:
        return self.start_step >= self.total_steps

    def start_text(self) -> str:
        """'fresh at step 0' or 'resumed from <checkpoint> at step N', and what became of an earlier run."""
        if self.resume_from is None:
            text = "fresh at step 0"
        elif self.model_dir:
            text = f"fresh at step 0 from the model in {self.resume_from} (checkpoint.load)"
        else:
            text = f"resumed from {self.resume_from} at step {self.start_step}"
            if not self.own_checkpoint:
                text += " (checkpoint.load)"
        if self.archive_to is not None:
            text += f"; the earlier run ({self.earlier_run}) moved to {self.archive_to}"
        elif self.earlier_run is not None and self.resume_from is None:
            text += f" again: the earlier launches ({self.earlier_run}) saved no checkpoint"
        if self.skipped:
            text += f"; skipped {'; '.join(self.skipped)}"
        return text

    def nothing_to_do_text(self) -> str:
        """Why this launch has no step to run, naming both numbers and how to continue."""
        where = self.output_dir if self.own_checkpoint else f"checkpoint.load={self.resume_from}"
        return (
            f"{where} is at step {self.start_step} of train.steps={self.total_steps}: nothing to do; raise "
            f"train.steps (e.g. train.steps={2 * self.start_step}) to continue, or choose a new output_dir"
        )


def run_entries(output_dir: Path) -> list[str]:
    """The names in `output_dir` a run wrote (RUN_ENTRIES and config.segment<N>.yaml), sorted."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p.name for p in output_dir.iterdir() if p.name in RUN_ENTRIES or _SEGMENT_CONFIG.fullmatch(p.name)
    )


def read_launches(output_dir: Path) -> list[dict[str, Any]]:
    """The rows of launches.jsonl, one per launch that got past its checks (a torn last line is skipped)."""
    path = output_dir / LAUNCHES
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _segment(output_dir: Path, entries: list[str], launches: list[dict[str, Any]]) -> int:
    """One more than any earlier launch's segment, by every record a launch leaves (0 for a fresh dir)."""
    candidates = [next_segment(output_dir / METRICS_FILE), len(launches)]
    candidates += [int(row.get("segment", -1)) + 1 for row in launches]
    candidates += [int(m.group(1)) + 1 for name in entries if (m := _SEGMENT_CONFIG.fullmatch(name))]
    candidates.append(1 if CONFIG in entries else 0)
    return max(candidates)


def _is_own_restart(launches: list[dict[str, Any]]) -> bool:
    """Whether torchrun restarted this job's workers after they committed to this output_dir."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return (
        launch_attempt() > 0
        and run_id is not None
        and bool(launches)
        and launches[-1].get("torchrun_run_id") == run_id
    )


def _checkpoint_step(path: Path) -> int:
    return int(read_meta(path)["step"])


def _describe_run(output_dir: Path, entries: list[str], own_checkpoint: Path | None) -> str:
    shown = ", ".join(name + ("/" if (output_dir / name).is_dir() else "") for name in entries)
    if own_checkpoint is not None:
        shown += f"; latest checkpoint at step {_checkpoint_step(own_checkpoint)}"
    return shown


def _archive_dir(output_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = output_dir / ARCHIVE / stamp, 1
    while candidate.exists():
        candidate, n = output_dir / ARCHIVE / f"{stamp}-{n}", n + 1
    return candidate


def _load_from(path: str) -> Path:
    """checkpoint.load as a checkpoint directory; a bad path's error names the field."""
    try:
        return resolve(Path(path))
    except CheckpointError as err:
        raise type(err)(f"checkpoint.load: {err}") from None


def plan_launch(job: JobConfig) -> Launch:
    """Inspect output_dir (read only) and decide how this launch starts; raise ConfigError to refuse."""
    output_dir = Path(job.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file; choose a directory for output_dir")
    entries = run_entries(output_dir)
    launches = read_launches(output_dir)
    own_root = output_dir / "checkpoints"
    own_checkpoint, skipped = last_good_checkpoint(own_root)
    earlier_run = _describe_run(output_dir, entries, own_checkpoint) if entries else None
    archive_to = None
    if earlier_run is not None and not _is_own_restart(launches):
        if job.checkpoint.archive_existing:
            archive_to, own_checkpoint = _archive_dir(output_dir), None
        elif not job.checkpoint.resume:
            raise ConfigError(
                f"output_dir={output_dir} holds a run ({earlier_run}) and checkpoint.resume=false; choose a "
                "new output_dir, or set checkpoint.archive_existing=true to move that run to "
                f"{output_dir / ARCHIVE}/<timestamp>/ and start afresh"
            )
    model_dir = own_checkpoint is None and bool(job.checkpoint.load) and is_model_dir(job.checkpoint.load)
    if own_checkpoint is not None:
        resume_from: Path | None = own_checkpoint
    elif model_dir:
        resume_from = Path(job.checkpoint.load)
        check_model_dir(resume_from, job.model)
    else:
        resume_from = _load_from(job.checkpoint.load) if job.checkpoint.load else None
    segment = 0 if archive_to is not None else _segment(output_dir, entries, launches)
    first_config = archive_to is not None or not (output_dir / CONFIG).exists()
    return Launch(
        output_dir=str(output_dir),
        segment=segment,
        start_step=_checkpoint_step(resume_from) if resume_from is not None and not model_dir else 0,
        resume_from=str(resume_from) if resume_from is not None else None,
        own_checkpoint=own_checkpoint is not None,
        earlier_run=earlier_run,
        archive_to=str(archive_to) if archive_to is not None else None,
        config_file=str(output_dir / (CONFIG if first_config else f"config.segment{segment}.yaml")),
        total_steps=job.train.steps,
        skipped=() if archive_to is not None else tuple(skipped),
        model_dir=model_dir,
    )


def commit(launch: Launch, job: JobConfig, world_size: int) -> None:
    """Rank 0's writes before training: archive the earlier run, write this launch's config, record it.

    A config file is never overwritten: the first launch's config.yaml stays, each later launch adds its own.
    """
    output_dir = Path(launch.output_dir)
    if launch.archive_to is not None:
        archive = Path(launch.archive_to)
        archive.mkdir(parents=True)
        for name in run_entries(output_dir):
            (output_dir / name).rename(archive / name)
    output_dir.mkdir(parents=True, exist_ok=True)
    _write_new(Path(launch.config_file), job)
    row = {
        "segment": launch.segment,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": Path(launch.config_file).name,
        "start_step": launch.start_step,
        "resumed_from": launch.resume_from,
        "world_size": world_size,
        "torchrun_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    }
    with open(output_dir / LAUNCHES, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def _write_new(path: Path, job: JobConfig) -> None:
    """Write the config to `path` atomically, refusing to replace an existing file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        dump(job, tmp)
        os.link(tmp, path)  # fails if `path` exists: an earlier launch's config is never replaced
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists (written by another launch into the same output_dir); "
            "run one launch per output_dir at a time"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
