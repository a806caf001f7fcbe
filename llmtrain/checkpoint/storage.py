"""Tensor storage through torch.distributed.checkpoint (DCP), plus checksums and atomic file writes.

What is stored and read is a GlobalTensor: the pieces of one full tensor this rank holds, each placed by its
offsets in the full tensor (llmtrain.parallel.param_layout).

Our planners hand DCP one write item per piece (its offsets in the full tensor) from the single
replica that owns it, and on load ask for exactly the rectangles each rank holds; DCP's resharding
helpers find which saved chunks overlap them. No rank ever materialises a full tensor it does not own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.parallel.param_layout import Piece

CHUNK = 1 << 20

# DCP warns on every single-process save/load; one process without torch.distributed is a supported mode here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class GlobalTensor:
    """The pieces of one full tensor this rank holds; `write` marks the one replica that saves them."""

    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    write: bool = True

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].tensor.dtype


class _SavePlanner(SavePlanner):
    """One SHARD write item per piece of every GlobalTensor this rank writes."""

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.entries: dict[str, GlobalTensor] = state_dict
        self.lookup: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, entry in self.entries.items():
            if not entry.write:
                continue
            for piece in entry.pieces:
                offsets = torch.Size(piece.offsets)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.tensor.shape),
                            properties=TensorProperties(dtype=piece.tensor.dtype),
                            size=torch.Size(entry.shape),
                        ),
                    )
                )
                self.lookup[(fqn, tuple(piece.offsets))] = piece.tensor
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        _check_coverage(metadata)
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.lookup[(write_item.index.fqn, tuple(write_item.index.offset))].detach()


def _check_coverage(metadata: Metadata) -> None:
    """Every saved tensor must be tiled exactly once by the pieces of all ranks (catches layout bugs)."""
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        if volume != math.prod(md.size):
            raise CheckpointError(
                f"tensor {fqn}: the ranks' pieces cover {volume} elements of its {math.prod(md.size)} "
                f"(shape {tuple(md.size)}); a layout marks no writer or two writers for some part"
            )


class _LoadPlanner(LoadPlanner):
    """Reads, for each piece this rank holds, the overlapping parts of the saved chunks.

    Pieces may overlap (a bf16 parameter and its fp32 master both read from the same saved tensor), so
    each piece gets its own id in the read items' destination index.
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.entries: dict[str, GlobalTensor] = state_dict
        self.metadata = metadata
        self.targets: list[torch.Tensor] = []

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, entry in self.entries.items():
            md = self.metadata.state_dict_metadata[fqn]
            for piece in entry.pieces:
                chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.shape)
                reads = create_read_items_for_chunk_list(fqn, md, [chunk])
                got = sum(math.prod(r.lengths) for r in reads)
                if got != piece.tensor.numel():
                    raise CheckpointError(
                        f"tensor {fqn}: the checkpoint holds {got} of the {piece.tensor.numel()} elements "
                        f"at offsets {piece.offsets}; a shard is missing from the checkpoint"
                    )
                dest = MetadataIndex(fqn, torch.Size(piece.offsets), len(self.targets))
                items.extend(dataclasses.replace(r, dest_index=dest) for r in reads)
                self.targets.append(piece.tensor)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"unexpected non-tensor entry {read_item.dest_index.fqn} in the checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[read_item.dest_index.index]
        for d, (o, s) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            if o != 0 or s != target.shape[d]:
                target = target.narrow(d, o, s)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


BeforeWrite = Callable[[Path, int], None]
"""Called before each write to a file with its path and the bytes already in it (fault injection)."""


class _RecordingFileSystem(FileSystem):
    """DCP's file system, keeping a CRC-32 and size of every file as it is written (no second read for the
    manifest) and the OSError of a failed write (torch.save turns it into an opaque RuntimeError)."""

    def __init__(self, before_write: BeforeWrite | None = None) -> None:
        super().__init__()
        self.errors: list[OSError] = []
        self.files: dict[Path, list[int]] = {}  # path -> [bytes, crc]
        self.before_write = before_write

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            record = self.files[Path(path)] = [0, 0]
            yield _RecordingStream(stream, self.errors, Path(path), record, self.before_write)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path) in self.files:
            self.files[Path(new_path)] = self.files.pop(Path(path))


class _RecordingStream:
    """A file being written sequentially: size and CRC-32 updated per write, failures recorded."""

    def __init__(
        self,
        stream: Any,
        errors: list[OSError],
        path: Path,
        record: list[int],
        before_write: BeforeWrite | None,
    ) -> None:
        self._stream, self._errors, self._path, self._record = stream, errors, path, record
        self._before_write = before_write

    def write(self, data: Any) -> int:
        try:
            if self._before_write is not None:
                self._before_write(self._path, self._record[0])
            n = self._stream.write(data)
        except OSError as err:
            self._errors.append(OSError(err.errno, err.strerror, str(self._path)))
            raise
        self._record[0] += n
        self._record[1] = zlib.crc32(data, self._record[1])
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def write_tensors(
    path: Path,
    entries: dict[str, GlobalTensor],
    group: dist.ProcessGroup | None,
    before_write: BeforeWrite | None = None,
) -> dict[str, dict[str, Any]]:
    """Write every rank's pieces under `path` (collective over `group` when distributed); return the files
    this rank wrote as {name relative to path: {"bytes", "crc32"}}.

    A failed write raises the OSError that caused it (disk full, quota, file-size limit) on the rank that
    hit it; DCP's CheckpointException elsewhere.
    """
    writer = dcp.FileSystemWriter(str(path))
    writer.fs = fs = _RecordingFileSystem(before_write)
    try:
        dcp.save(
            entries, storage_writer=writer, planner=_SavePlanner(), process_group=group, no_dist=group is None
        )
    except (Exception, CheckpointException):
        if fs.errors:
            raise fs.errors[0] from None
        raise
    return {
        str(p.relative_to(path)): {"bytes": size, "crc32": f"{crc:08x}"}
        for p, (size, crc) in fs.files.items()
        if p.exists()
    }


def read_metadata(path: Path) -> Metadata:
    """DCP's index of a checkpoint: every tensor's full shape, dtype and saved chunks."""
    return dcp.FileSystemReader(str(path)).read_metadata()


def read_tensors(path: Path, entries: dict[str, GlobalTensor], group: dist.ProcessGroup | None) -> None:
    """Fill every piece of `entries` from the checkpoint at `path` (collective over `group`)."""
    dcp.load(
        entries,
        storage_reader=dcp.FileSystemReader(str(path)),
        planner=_LoadPlanner(),
        process_group=group,
        no_dist=group is None,
    )


def file_checksum(path: Path) -> str:
    """CRC-32 of a file as 8 hex digits (about 4 GB/s: fast enough to verify every load)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a partial file behind
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
