"""Checkpointer: sharded, checksummed, atomically published checkpoints with optional async saving.

Layout of `<output_dir>/checkpoints/`:
    step_<N>/            a complete checkpoint (has manifest.json, written last)
        .metadata, __<rank>_<i>.distcp   DCP index and each rank's tensor pieces
        rng/rank_<r>.pt  RNG states of rank r
        trainer_state.pt the trainer's `extra` (LR schedule, loss scaler, consumed samples, ...)
        tokenizer/       the run's tokenizer files (tokenizer.model, or a Hugging Face tokenizer's files)
        meta.json        step, model config, job config, layout that wrote it
        manifest.json    size and CRC-32 of every file above
    latest               name of the newest complete checkpoint (replaced atomically)
    .tmp_step_<N>/       a save in progress (or one that crashed): never loaded, removed by the next save
Every rank writes into the same directory, so output_dir must be on a file system all ranks share.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import io
import json
import shlex
import shutil
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

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.layout import GlobalTensor, Piece
from llmtrain.checkpoint.state import (
    MODEL,
    OPTIM,
    capture_rng,
    describe_model,
    model_entries,
    optimizer_entries,
    optimizer_scalars,
    optimizer_targets,
    restore_rng,
)
from llmtrain.checkpoint.storage import (
    file_checksum,
    fsync_dir,
    read_metadata,
    read_tensors,
    write_atomic,
    write_tensors,
)
from llmtrain.config import JobConfig, ModelConfig, to_dict
from llmtrain.models.hf import HF_CONFIG, LLMTRAIN_CONFIG

FORMAT = "llmtrain-dcp-1"
MANIFEST = "manifest.json"
META = "meta.json"
TRAINER_STATE = "trainer_state.pt"
TOKENIZER_DIR = "tokenizer"
LATEST = "latest"
DISK_FULL = "disk full (or quota / file-size limit reached)"

# (config field, resolved property) pairs that change the model's tensors: compared on load.
SHAPE_FIELDS = (
    ("arch", "arch"),
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_kv_heads", "kv_heads"),
    ("head_dim", "head_size"),
    ("ffn_hidden_size", "ffn_size"),
    ("vocab_size", "vocab_size"),
    ("tie_word_embeddings", "tied_embeddings"),
    ("use_bias", "bias"),
)


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

    def __init__(self, job: JobConfig, topo: Any = None, tokenizer: Any = None) -> None:
        if job.checkpoint.keep < 1:
            raise CheckpointError(f"checkpoint.keep must be at least 1; got {job.checkpoint.keep}")
        self.job = job
        self.topo = topo
        self.tokenizer = tokenizer
        self.root = Path(job.output_dir) / "checkpoints"
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
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
        async), with the seconds from this call until then.
        """
        self.wait()
        start = time.perf_counter()
        params = describe_model(model, self.topo, self.job.model.tied_embeddings)
        entries = model_entries(params, self.topo)
        if optimizer is not None:
            entries.update(optimizer_entries(optimizer, params, self.topo))
        scalars = optimizer_scalars(optimizer) if optimizer is not None else {}
        snap = _Snapshot(step, entries, extra, capture_rng(model), scalars)

        def commit(snap: _Snapshot) -> None:
            self._commit(snap)
            if on_saved is not None:
                on_saved(self.root / f"step_{step}", time.perf_counter() - start)

        if self._pool is None:
            commit(snap)
        else:
            self._pending = self._pool.submit(commit, snap.staged())

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
        tmp = self.root / f".tmp_step_{snap.step}"
        self._everywhere(lambda: self._prepare(tmp) if self.rank == 0 else None, snap.step, tmp)
        written = self._everywhere(lambda: write_tensors(tmp, snap.entries, self.group), snap.step, tmp)
        files = self._everywhere(lambda: self._write_local(tmp, snap), snap.step, tmp)
        manifest = {name: info for part in written + files for name, info in part.items()}
        self._everywhere(
            lambda: self._publish(tmp, snap.step, manifest) if self.rank == 0 else None, snap.step, tmp
        )

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in list(self.root.glob(".tmp_step_*")) + list(self.root.glob(".old_step_*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save; never loadable
        (tmp / "rng").mkdir(parents=True)

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
        for name, data in files.items():
            write_atomic(tmp / name, data)
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
        write_atomic(
            tmp / MANIFEST,
            json.dumps(
                {"format": FORMAT, "step": step, "files": manifest}, indent=1, sort_keys=True
            ).encode(),
        )
        final = self.root / f"step_{step}"
        old = self.root / f".old_step_{step}"
        if final.exists():  # saving a step again (e.g. the final step after a resume): swap it out
            final.rename(old)
        tmp.rename(final)
        fsync_dir(self.root)
        write_atomic(self.root / LATEST, f"step_{step}\n".encode())
        shutil.rmtree(old, ignore_errors=True)
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        done = [p for p in self.root.glob("step_*") if (p / MANIFEST).exists() and p != newest]
        done.sort(key=lambda p: (p / MANIFEST).stat().st_mtime_ns)
        for p in done[: max(0, len(done) - (self.job.checkpoint.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)

    def _everywhere(self, fn: Callable[[], Any], step: int, tmp: Path) -> list[Any]:
        """Run `fn` on every rank and agree on success; on any failure the save is abandoned everywhere."""
        try:
            result: tuple[bool, Any] = (True, fn())
        except (Exception, CheckpointException) as err:  # reported to all ranks below
            result = (False, f"rank {self.rank}: {_describe(err)}")
        results = [result]
        if self.group is not None:
            results = [None] * self.world_size
            dist.all_gather_object(results, result, group=self.group)
        errors = [r[1] for r in results if not r[0]]
        if errors:
            # The root cause first (a full disk on one rank shows as a write failure on the others).
            errors.sort(key=lambda e: DISK_FULL not in e)
            self._fail(
                step,
                tmp,
                "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""),
            )
        return [r[1] for r in results]

    def _fail(self, step: int, tmp: Path, cause: str) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        last = (self.root / LATEST).read_text().strip() if (self.root / LATEST).exists() else None
        keep = (
            f"the last good checkpoint {self.root / last} is untouched"
            if last
            else "no earlier checkpoint exists"
        )
        raise CheckpointError(f"saving checkpoint step_{step} in {self.root} failed: {cause}; {keep}")

    # ---------------------------------------------------------------- load
    def load(self, path: str | Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """Restore model, optimizer (if given) and this rank's RNG states; return the saved `extra`."""
        self.wait()
        path = resolve(Path(path))
        verify(path, self.rank, self.world_size, self.group)
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
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        if meta["world_size"] == self.world_size and rng_file.exists():
            restore_rng(torch.load(rng_file, weights_only=True), model)
        elif self.rank == 0:
            warnings.warn(
                f"{path} was saved by {meta['world_size']} ranks, this job has {self.world_size}: "
                "RNG states are not restored (weights, optimizer and data position are)",
                stacklevel=2,
            )
        return trainer["extra"]


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _describe(err: BaseException) -> str:
    """A one-line cause: disk-full errors say so plainly, DCP's per-rank wrapping is unwrapped."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{DISK_FULL} writing {err.filename}: {err.strerror}"
    if isinstance(err, CheckpointException) and err.failures:
        inner = next(iter(err.failures.values()))[0]
        return f"{type(inner).__name__}: {inner}"
    return f"{type(err).__name__}: {err}"


# -------------------------------------------------------------------- checkpoint-level helpers
EXPECTED = "give a step_<N> directory, a checkpoints/ directory or an output_dir that holds one"


def resolve(path: Path) -> Path:
    """A complete step directory from a step dir, a checkpoints dir or an output_dir (via `latest`).

    Anything else raises a CheckpointError naming what `path` is instead (nothing, an incomplete save, a
    Hugging Face or llmtrain model directory, which it says how to convert) and what to give.
    """
    for candidate in (path, path / "checkpoints"):
        pointer = candidate / LATEST
        if pointer.is_file():
            target = candidate / pointer.read_text().strip()
            if not (target / MANIFEST).is_file():
                raise CheckpointError(
                    f"{pointer} names {target.name}, which is not a complete checkpoint "
                    f"({MANIFEST} missing); point checkpoint.load at an earlier step_<N>"
                )
            return target
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; {EXPECTED}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; {EXPECTED}")
    kind = model_directory_kind(path)
    if kind is not None:
        out = path.with_name(f"{path.name}-checkpoint")
        raise CheckpointError(
            f"{path} is {kind}, not a training checkpoint; convert it first: python "
            f"tools/convert_checkpoint.py hf-to-llmtrain --input {shlex.quote(str(path))} --output "
            f"{shlex.quote(str(out))} --tp N --pp N (your training layout), then load {shlex.quote(str(out))}"
        )
    if (path / ".metadata").exists() or any(path.glob("*.distcp")):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint ({MANIFEST} missing: its save was interrupted); "
            "load an earlier step_<N>"
        )
    raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST} and no {LATEST} pointer); {EXPECTED}")


def model_directory_kind(path: Path) -> str | None:
    """'a Hugging Face model directory' or 'an llmtrain model directory' by the config file in `path`."""
    if (path / HF_CONFIG).is_file():
        return "a Hugging Face model directory"
    if (path / LLMTRAIN_CONFIG).is_file():
        return "an llmtrain model directory"
    return None


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is meant as a training checkpoint (complete or not) rather than a model directory:
    a step directory, a checkpoints/ directory or an output_dir with one."""
    path = Path(path)
    return (path / "checkpoints").is_dir() or any(
        (path / p).exists() for p in (MANIFEST, LATEST, ".metadata")
    )


def verify(
    path: Path, rank: int = 0, world_size: int = 1, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Check every file in the manifest exists with its size and CRC-32 (the ranks split the reading)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("its 'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path / MANIFEST} is unreadable or corrupt ({err}); copy the checkpoint again or load an "
            "earlier step_<N>"
        ) from err
    problems = []
    for name in sorted(files)[rank::world_size]:
        f, want = path / name, files[name]
        if not f.is_file():
            problems.append(f"{f} is missing (a shard of this checkpoint was deleted or never copied)")
        elif f.stat().st_size != want["bytes"]:
            problems.append(
                f"{f} is truncated or overwritten: {f.stat().st_size} bytes, expected {want['bytes']}"
            )
        elif (crc := file_checksum(f)) != want["crc32"]:
            problems.append(f"{f} is corrupt: CRC-32 {crc}, manifest says {want['crc32']}")
    if group is not None:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} failed verification: {'; '.join(problems)}; copy the checkpoint again from "
            "its source or load an earlier step_<N>"
        )
    return manifest


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json (format, step, model and job config, layout)."""
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
            raise ValueError("no model section")
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / META} is missing or corrupt ({err}); copy the checkpoint again or load an earlier "
            "step_<N>"
        ) from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / META}: format {meta.get('format')!r} is not {FORMAT!r}; this checkpoint was written by "
            "another tool or version: load it with the version that wrote it"
        )
    return meta


def saved_model_config(path: Path, meta: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a checkpoint's meta.json records."""
    try:
        return ModelConfig(**meta["model"])
    except TypeError as err:
        raise CheckpointError(
            f"{path / META} records a model config this version does not know ({err}); load it with the "
            "llmtrain version that wrote it"
        ) from None


def check_model_config(path: Path, meta: dict[str, Any], model: ModelConfig) -> None:
    """Raise naming the first model field whose saved value gives other tensors than this job's."""
    saved = saved_model_config(path, meta)
    for field, prop in SHAPE_FIELDS:
        a, b = getattr(saved, prop), getattr(model, prop)
        if a != b:
            raise CheckpointError(
                f"{path} holds a model with model.{field}={a}, this job has model.{field}={b}; "
                f"set model.{field}={a} or load a checkpoint of this model"
            )
    if model.arch == "gpt" and saved.max_positions != model.max_positions:
        raise CheckpointError(
            f"{path} holds a position table of {saved.max_positions} rows, this job has "
            f"{model.max_positions}; set model.max_position_embeddings={saved.max_positions}"
        )


def check_tensors(
    path: Path, metadata: Any, expected: dict[str, tuple[int, ...]], whole: bool = True
) -> None:
    """Raise naming the first model tensor that is missing, of another shape, or (`whole` model) extra."""
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    for key, shape in expected.items():
        if key not in saved:
            raise CheckpointError(
                f"{path} has no tensor {key[len(MODEL) :]}; it was saved from another model"
            )
        if saved[key] != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {key[len(MODEL) :]} has shape {saved[key]} in the checkpoint, "
                f"{tuple(shape)} in this model"
            )
    for key in sorted(saved.keys() - expected.keys()) if whole else ():
        raise CheckpointError(
            f"{path} holds tensor {key[len(MODEL) :]} that this model does not have; "
            "it was saved from another model"
        )
