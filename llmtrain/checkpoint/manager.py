"""Checkpointer: sharded, checksummed, atomically published checkpoints with optional async saving.

The layout of the checkpoints directory it writes is llmtrain.checkpoint.directory's.

A save goes through these phases (`SAVE_PHASES`, the names of the `kill_during_save` fault that SIGKILLs a
rank there, see llmtrain/faults.py): stage (the snapshot is taken; copied to CPU when async), prepare
(rank 0 creates .tmp_step_<N>), shards (every rank writes its DCP tensor file), metadata (rank 0 writes
DCP's .metadata), local_files (RNG states, trainer state, meta.json, tokenizer), manifest (rank 0 writes
manifest.json into .tmp_step_<N>), swap (an existing step_<N> moved aside), publish (.tmp_step_<N> renamed
to step_<N>), latest (the pointer replaced), prune (an older checkpoint renamed to .deleting_step_<M>,
then removed). A save counts once `latest` names it: a rank killed before that leaves the run resuming
from the previous checkpoint, which pruning removes only after that. A save that fails on any rank is
published on none.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import io
import json
import os
import shutil
import signal
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from llmtrain.checkpoint.directory import (
    EXPECTED,
    FORMAT,
    LATEST,
    MANIFEST,
    META,
    TOKENIZER_DIR,
    TRAINER_STATE,
    check_model_config,
    check_tensors,
    is_checkpoint,
    last_good_checkpoint,
    model_directory_kind,
    read_meta,
    resolve,
    saved_model_config,
    step_of,
    verify,
)
from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.state import (
    MODEL,
    OPTIM,
    capture_rng,
    model_entries,
    optimizer_entries,
    optimizer_scalars,
    optimizer_targets,
    restore_rng,
)
from llmtrain.checkpoint.storage import (
    BeforeWrite,
    GlobalTensor,
    fsync_dir,
    read_metadata,
    read_tensors,
    write_atomic,
    write_tensors,
)
from llmtrain.config import JobConfig, to_dict
from llmtrain.config.engine_rules import float8_all_gather
from llmtrain.faults import injected
from llmtrain.parallel.float8_gather import precompute_weight_scales
from llmtrain.parallel.param_layout import Piece, describe_model

# The checkpoint-directory functions lived here before llmtrain.checkpoint.directory; callers import them
# from either module.
__all__ = [
    "EXPECTED",
    "SAVE_PHASES",
    "TOKENIZER_DIR",
    "TRAINER_STATE",
    "Checkpointer",
    "is_checkpoint",
    "last_good_checkpoint",
    "model_directory_kind",
    "read_meta",
    "resolve",
    "saved_model_config",
    "verify",
]

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SAVE_PHASES = (
    "stage",
    "prepare",
    "shards",
    "metadata",
    "local_files",
    "manifest",
    "swap",
    "publish",
    "latest",
    "prune",
)
KILL_DURING_SAVE = "kill_during_save"
"""Fault (tests): SIGKILL the rank named by `rank` at `phase` (one of SAVE_PHASES) of the save of `step`."""
DISK_FULL = "disk_full"
"""Fault (tests): writing `file` (a name in the checkpoint; any file if left out) on `rank` at `step`
fails with ENOSPC, as on a full disk."""


@dataclasses.dataclass
class _Snapshot:
    """Everything one rank contributes to a checkpoint."""

    step: int
    entries: dict[str, GlobalTensor]
    extra: dict[str, Any]
    rng: dict[str, Any] | None
    scalars: dict[str, Any]

    def staged(self) -> _Snapshot:
        """A private CPU copy, so training may change the live tensors while this one is written."""
        pin = torch.cuda.is_available()
        entries = {}
        for fqn, e in self.entries.items():
            pieces = []
            for p in e.pieces:
                t = torch.empty(p.tensor.shape, dtype=p.tensor.dtype, pin_memory=pin)
                t.copy_(p.tensor.detach(), non_blocking=pin)
                pieces.append(Piece(t, p.offsets))
            entries[fqn] = GlobalTensor(e.shape, pieces, e.write)
        if pin:
            torch.cuda.synchronize()
        return _Snapshot(self.step, entries, copy.deepcopy(self.extra), self.rng, copy.deepcopy(self.scalars))


class Checkpointer:
    """Saves and loads sharded checkpoints of one job; every rank constructs one (collective)."""

    def __init__(self, job: JobConfig, topo: Any = None, tokenizer: Any = None, alone: bool = False) -> None:
        """`alone`: this process writes the whole checkpoint by itself, even inside a process group (an
        offline conversion, or rank 0 converting a model directory for its run)."""
        if job.checkpoint.keep < 1:
            raise CheckpointError(f"checkpoint.keep must be at least 1; got {job.checkpoint.keep}")
        self.job = job
        self.topo = topo
        self.tokenizer = tokenizer
        self.root = Path(job.output_dir) / "checkpoints"
        distributed = (
            not alone and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # Every checkpoint carries the tokenizer's files (rank 0 writes them), read once here: the tokenizer
        # this run started with, even if its file is replaced while the run goes on.
        self._tokenizer_files = tokenizer.files() if tokenizer is not None and self.rank == 0 else {}
        # A gloo group of our own: checkpoint collectives run on a background thread (async save)
        # and must not interleave with the trainer's collectives, which may be NCCL.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if job.checkpoint.async_save else None
        )
        self._pending: Future | None = None
        self.last_good: Path | None = None
        """The checkpoint this run loaded or last published: what a failed save leaves in place."""

    # ---------------------------------------------------------------- paths
    def resume_path(self) -> Path | None:
        """output_dir's latest if checkpoint.resume, else checkpoint.load; None if there is neither.

        The run's own checkpoint wins, so rerunning an interrupted fine-tune continues it; a training launch
        decides through llmtrain.training.output_dir, which adds the refusals and archiving.
        """
        if self.job.checkpoint.resume and (self.root / LATEST).exists():
            return resolve(self.root)
        if self.job.checkpoint.load:
            return resolve(Path(self.job.checkpoint.load))
        return None

    def is_due(self, step: int, final: bool = False) -> bool:
        """Whether the trainer should save after `step` (every checkpoint.interval steps, and the last)."""
        interval = self.job.checkpoint.interval
        return final or (interval > 0 and step % interval == 0)

    # ---------------------------------------------------------------- save
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Any,
        extra: dict[str, Any],
        on_saved: Callable[[Path, float], None] | None = None,
    ) -> None:
        """Checkpoint model, optimizer, RNG states and `extra` as step_<step> (returns early if async).

        `on_saved(path, seconds)` runs once the checkpoint is published (on the background thread when
        async), with the seconds from this call until then. A save that fails on any rank (a full disk, a
        write error) is published on none, its partial files are removed and the last good checkpoint
        stays; then checkpoint.on_save_error=continue prints one line on rank 0 and training goes on, and
        `stop` raises a CheckpointError on every rank (from the next `save` or `wait` when async).
        """
        self.wait()
        start = time.perf_counter()
        if hasattr(optimizer, "checkpoint_view"):
            # An engine keeping its state elsewhere (DeepSpeed) presents it as full tensors.
            model, optimizer = optimizer.checkpoint_view()
        params = describe_model(model, self.topo, self.job.model.tied_embeddings)
        entries = model_entries(params, self.topo)
        if optimizer is not None:
            entries.update(optimizer_entries(optimizer, params, self.topo))
        scalars = optimizer_scalars(optimizer) if optimizer is not None else {}
        snap = _Snapshot(step, entries, extra, capture_rng(model), scalars)
        if self._pool is not None:
            snap = snap.staged()
        self._kill_point("stage", step)

        def commit(snap: _Snapshot) -> None:
            try:
                self._commit(snap)
            except _SaveFailed as failure:
                self._save_failed(str(failure))
                return
            if on_saved is not None:
                on_saved(self.root / f"step_{step}", time.perf_counter() - start)

        if self._pool is None:
            commit(snap)
        else:
            self._pending = self._pool.submit(commit, snap)

    def _save_failed(self, message: str) -> None:
        """Act on a save every rank agreed has failed, as checkpoint.on_save_error says."""
        if self.job.checkpoint.on_save_error == "stop":
            resume = f" to resume from {self.last_good.name}" if self.last_good is not None else ""
            raise CheckpointError(
                f"{message}; stopping (checkpoint.on_save_error=stop): free space or fix the cause, then "
                f"rerun the same command{resume}"
            )
        if self.rank == 0:
            print(
                f"{message}; training goes on (checkpoint.on_save_error=continue)",
                file=sys.stderr,
                flush=True,
            )

    def wait(self) -> None:
        """Block until the async save in flight (if any) is published; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the save in flight and release the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _commit(self, snap: _Snapshot) -> None:
        step = snap.step
        tmp = self.root / f".tmp_step_{step}"
        self._everywhere(lambda: self._prepare(tmp, step), step, tmp)
        written = self._everywhere(
            lambda: write_tensors(tmp, snap.entries, self.group, self._before_write(step)), step, tmp
        )
        files = self._everywhere(lambda: self._write_local(tmp, snap), step, tmp)
        manifest = {name: info for part in written + files for name, info in part.items()}
        self._everywhere(lambda: self._publish(tmp, step, manifest) if self.rank == 0 else None, step, tmp)
        self.last_good = self.root / f"step_{step}"
        if self.rank == 0:
            self._after_publish(step)

    def _kill_point(self, phase: str, step: int) -> None:
        """SIGKILL this process here when the kill_during_save fault names this phase, rank and step."""
        if injected(KILL_DURING_SAVE, phase=phase, rank=self.rank, step=step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def _before_write(self, step: int) -> BeforeWrite:
        """The fault-injection hook run before every write of a checkpoint file of `step` on this rank."""

        def check(path: Path, written: int) -> None:
            if injected(DISK_FULL, rank=self.rank, step=step, file=path.name) is not None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            if path.name.startswith(".metadata"):
                self._kill_point("metadata", step)
            elif written > 0:  # in the middle of a file, so a torn shard is left behind
                self._kill_point("shards", step)

        return check

    def _prepare(self, tmp: Path, step: int) -> None:
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for pattern in (".tmp_step_*", ".old_step_*", ".deleting_step_*"):
                for stale in self.root.glob(pattern):
                    shutil.rmtree(stale, ignore_errors=True)  # left by a killed save; never loadable
            (tmp / "rng").mkdir(parents=True)
        self._kill_point("prepare", step)

    def _write_local(self, tmp: Path, snap: _Snapshot) -> dict[str, dict[str, Any]]:
        files: dict[str, bytes] = {}
        if snap.rng is not None:  # offline conversions have no RNG state to keep
            files[f"rng/rank_{self.rank:05d}.pt"] = _torch_bytes(snap.rng)
        if self.rank == 0:
            files[TRAINER_STATE] = _torch_bytes({"extra": snap.extra, "optimizer": snap.scalars})
            files[META] = json.dumps(self._meta(snap.step), indent=1).encode()
            if self._tokenizer_files:
                (tmp / TOKENIZER_DIR).mkdir()
                files.update({f"{TOKENIZER_DIR}/{n}": data for n, data in self._tokenizer_files.items()})
        check = self._before_write(snap.step)
        for name, data in files.items():
            check(tmp / name, 0)
            write_atomic(tmp / name, data)
            self._kill_point("local_files", snap.step)
        return {
            name: {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"} for name, data in files.items()
        }

    def _meta(self, step: int) -> dict[str, Any]:
        t = self.topo
        layout = (
            {k: getattr(t, k, 1) for k in ("tp", "pp", "dp")}
            if t is not None
            else {"tp": 1, "pp": 1, "dp": 1}
        )
        return {
            "format": FORMAT,
            "step": step,
            "world_size": getattr(t, "world_size", self.world_size),
            "layout": {
                **layout,
                "virtual_stages": self.job.parallel.virtual_stages,
                "zero_stage": self.job.parallel.zero_stage,
            },
            "model": dataclasses.asdict(self.job.model),
            "job": to_dict(self.job),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _publish(self, tmp: Path, step: int, manifest: dict[str, Any]) -> None:
        """Rank 0: write the manifest, rename the checkpoint into place, then point `latest` at it."""
        write_atomic(
            tmp / MANIFEST,
            json.dumps(
                {"format": FORMAT, "step": step, "files": manifest}, indent=1, sort_keys=True
            ).encode(),
        )
        self._kill_point("manifest", step)
        final = self.root / f"step_{step}"
        if final.exists():  # saving a step again (after a resume from an earlier one): swap it out
            final.rename(self.root / f".old_step_{step}")
            self._kill_point("swap", step)
        tmp.rename(final)
        fsync_dir(self.root)
        self._kill_point("publish", step)
        try:
            write_atomic(self.root / LATEST, f"step_{step}\n".encode())
        except BaseException:
            final.rename(tmp)  # not counted without `latest`: back where the failed save's files are removed
            raise
        self._kill_point("latest", step)

    def _after_publish(self, step: int) -> None:
        """Rank 0, once `latest` names step_<step>: remove the checkpoints it replaced or made surplus.

        The checkpoint is saved whatever happens here, so a failure is one line, not a failed save.
        """
        try:
            shutil.rmtree(self.root / f".old_step_{step}", ignore_errors=True)
            self._prune(step)
        except OSError as err:
            print(
                f"checkpoint step_{step} saved, but removing older checkpoints from {self.root} failed: "
                f"{_describe(err, self.root)}",
                file=sys.stderr,
                flush=True,
            )

    def _prune(self, newest: int) -> None:
        """Remove all but the checkpoint.keep - 1 newest checkpoints older than step `newest`.

        Each is renamed first, so a kill in the middle of removing it never leaves a partial step_<M>.
        Checkpoints of later steps (skipped on resume as incomplete or corrupt) are replaced when
        training reaches their step.
        """
        older = sorted(s for p in self.root.iterdir() if (s := step_of(p)) is not None and s < newest)
        for step in older[: max(0, len(older) - (self.job.checkpoint.keep - 1))]:
            doomed = self.root / f".deleting_step_{step}"
            (self.root / f"step_{step}").rename(doomed)
            self._kill_point("prune", newest)
            shutil.rmtree(doomed, ignore_errors=True)

    def _everywhere(self, fn: Callable[[], Any], step: int, tmp: Path) -> list[Any]:
        """Run `fn` on every rank and agree on success; on any failure the save is abandoned everywhere."""
        try:
            result: tuple[bool, Any, bool] = (True, fn(), False)
        except (Exception, CheckpointException) as err:  # reported to all ranks below
            result = (False, f"rank {self.rank}: {_describe(err, self.root)}", _out_of_space(err))
        results = [result]
        if self.group is not None:
            results = [None] * self.world_size
            dist.all_gather_object(results, result, group=self.group)
        failed = [r for r in results if not r[0]]
        if failed:
            # The root cause first (a full disk on one rank shows as a write failure on the others).
            failed.sort(key=lambda r: not r[2])
            errors = [r[1] for r in failed]
            cause = "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
            self._fail(step, tmp, f"no space left in {self.root} ({cause})" if failed[0][2] else cause)
        return [r[1] for r in results]

    def _fail(self, step: int, tmp: Path, cause: str) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        last = self.last_good
        if last is None and (self.root / LATEST).is_file():  # a Checkpointer that loaded nothing
            last = self.root / (self.root / LATEST).read_text().strip()
        kept = f"kept {last}" if last is not None and last.exists() else "no earlier checkpoint exists"
        raise _SaveFailed(f"checkpoint step_{step} not saved: {cause}; its partial files are removed; {kept}")

    # ---------------------------------------------------------------- load
    def load(self, path: str | Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """Restore model, optimizer (if given) and this rank's RNG states; return the saved `extra`."""
        self.wait()
        engine = None
        if hasattr(optimizer, "checkpoint_view"):
            # An engine keeping its state elsewhere (DeepSpeed) reads into full tensors, then installs them.
            engine, (model, optimizer) = optimizer, optimizer.checkpoint_view(loading=True)
        path = resolve(Path(path))
        verify(path, self.rank, self.world_size, self.group)
        self.last_good = path
        meta = read_meta(path)
        check_model_config(path, meta, self.job.model)
        params = describe_model(model, self.topo, self.job.model.tied_embeddings)
        metadata = read_metadata(path)
        entries = model_entries(params, self.topo)
        whole = getattr(self.topo, "pp", 1) == 1  # under pipeline parallelism a rank holds some tensors only
        check_tensors(path, metadata, {k: e.shape for k, e in entries.items()}, whole)
        saved = metadata.state_dict_metadata
        for name, m in params.items():
            # fp32 weights come from the fp32 masters when the checkpoint has them (a bf16/fp16 run).
            master = f"{OPTIM}{name}.master"
            if m.tensor.dtype == torch.float32 and master in saved:
                entries[master] = entries.pop(MODEL + name)
        install = None
        if optimizer is not None:
            opt_entries, install = optimizer_targets(optimizer, params, self.topo, metadata)
            for fqn, e in opt_entries.items():
                entries.setdefault(fqn, GlobalTensor(e.shape, [])).pieces.extend(e.pieces)
        read_tensors(path, entries, self.group)
        trainer = torch.load(path / TRAINER_STATE, weights_only=True)
        if install is not None:
            install(trainer["optimizer"])
        if engine is not None:
            engine.restore(model, optimizer)
        if float8_all_gather(self.job):  # the loaded weights' scales for their float8 gathers
            precompute_weight_scales(model)
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        if meta["world_size"] == self.world_size and rng_file.exists():
            restore_rng(torch.load(rng_file, weights_only=True), model)
        elif self.rank == 0 and any((path / "rng").glob("rank_*.pt")):  # a conversion saves no RNG state
            warnings.warn(
                f"{path} was saved by {meta['world_size']} ranks, this job has {self.world_size}: "
                "RNG states are not restored (weights, optimizer and data position are)",
                stacklevel=2,
            )
        return trainer["extra"]


class _SaveFailed(CheckpointError):
    """A save every rank agreed has failed; Checkpointer.save acts on it per checkpoint.on_save_error."""


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _out_of_space(err: BaseException) -> bool:
    """Whether `err` is a write refused for space: a full disk, a quota or a file-size limit."""
    return isinstance(err, OSError) and err.errno in OUT_OF_SPACE


def _describe(err: BaseException, root: Path) -> str:
    """A one-line cause: an OSError names its file (relative to `root`), DCP's per-rank wrapping is
    unwrapped."""
    if isinstance(err, OSError) and err.filename is not None:
        name = Path(err.filename)
        shown = name.relative_to(root) if name.is_relative_to(root) else name
        return f"{err.strerror} writing {shown}"
    if isinstance(err, CheckpointException) and err.failures:
        inner = next(iter(err.failures.values()))[0]
        return f"{type(inner).__name__}: {inner}"
    return f"{type(err).__name__}: {err}"
