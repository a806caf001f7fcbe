"""Where each rank's local tensors sit inside the full (single-process) tensors.

A `ParamLayout` maps a rank's local tensor (of a parameter, or anything shaped like it: gradients, Adam
moments, fp32 master weights) onto the full tensor as a set of rectangular blocks. `describe_model` names
every parameter and persistent buffer of a rank's model part by its single-process name and gives it its
layout, read from the attributes llmtrain.parallel puts on each parameter (`tp_layout`: "rows" | "cols" |
"gate_up" | ("kv", replicas); `duplicate`: another TP rank holds the same values; `expert_slice`: an
expert-parallel shard). ZeRO-2/3 parameters are FSDP2 DTensors whose local shard is rows [a, b) of the
TP-local tensor, i.e. a flat range of it (`llmtrain.parallel.dtensor_shards.shard_position`,
`ParamLayout.flat_pieces`).

Checkpoints save and load every piece by its offsets in the full tensor (llmtrain.checkpoint.state), so a
checkpoint never stores a layout; `materialize` initialises each rank's pieces of a sharded model from the
same description. A layout that does not fit its tensor raises CheckpointError (llmtrain.errors), the error
a checkpoint's save or load reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmtrain.errors import CheckpointError
from llmtrain.parallel.dtensor_shards import local_tensor, shard_position


@dataclass(frozen=True)
class Block:
    """A rectangle of a local tensor and the offsets of its first element in the full tensor."""

    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_offsets: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """A view holding one rectangle of a full tensor, placed at `offsets`."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class ParamLayout:
    """How a local tensor of shape `local_shape` tiles into the full tensor of shape `global_shape`.

    `writer` is False on replicas (data-parallel copies, kv heads repeated over tensor-parallel
    ranks, the tied output embedding of the last pipeline stage) so each element is written once.
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    writer: bool = True

    @staticmethod
    def full(shape: Sequence[int], writer: bool = True) -> ParamLayout:
        """The layout of an unsharded tensor."""
        shape = tuple(shape)
        zero = (0,) * len(shape)
        return ParamLayout(shape, shape, (Block(zero, shape, zero),), writer)

    @staticmethod
    def split(
        global_shape: Sequence[int], dim: int, parts: Sequence[tuple[int, int]], writer: bool = True
    ) -> ParamLayout:
        """Local tensor = the full tensor's ranges (start, size) of `parts`, concatenated along `dim`."""
        global_shape = tuple(global_shape)
        blocks, local_start = [], 0
        for start, size in parts:
            sizes = global_shape[:dim] + (size,) + global_shape[dim + 1 :]
            local = [0] * len(global_shape)
            local[dim] = local_start
            glob = [0] * len(global_shape)
            glob[dim] = start
            blocks.append(Block(tuple(local), sizes, tuple(glob)))
            local_start += size
        local_shape = global_shape[:dim] + (local_start,) + global_shape[dim + 1 :]
        return ParamLayout(global_shape, local_shape, tuple(blocks), writer)

    def check(self, name: str) -> None:
        """Raise if the blocks leave the local or the full tensor or do not tile the local tensor."""
        covered = 0
        for b in self.blocks:
            for d, size in enumerate(b.sizes):
                if (
                    b.local_offsets[d] + size > self.local_shape[d]
                    or b.global_offsets[d] + size > self.global_shape[d]
                ):
                    raise CheckpointError(
                        f"layout of {name}: block {b} leaves local {self.local_shape} "
                        f"or full shape {self.global_shape}"
                    )
            covered += math.prod(b.sizes)
        if covered != math.prod(self.local_shape):
            raise CheckpointError(
                f"layout of {name}: blocks cover {covered} of {math.prod(self.local_shape)} local elements"
            )

    def holds_origin(self) -> bool:
        """Whether the local tensor holds element 0 of the full tensor."""
        return any(not any(b.global_offsets) for b in self.blocks)

    def pieces(self, tensor: torch.Tensor) -> list[Piece]:
        """Views of `tensor` (shaped like the local parameter) for each block."""
        if tuple(tensor.shape) != self.local_shape:
            raise CheckpointError(
                f"tensor of shape {tuple(tensor.shape)} does not match the local shape "
                f"{self.local_shape} of its parameter"
            )
        return [Piece(_narrow(tensor, b.local_offsets, b.sizes), b.global_offsets) for b in self.blocks]

    def flat_pieces(self, flat: torch.Tensor, start: int) -> list[Piece]:
        """Pieces of a 1-D tensor holding elements [start, start+len) of the flattened local tensor.

        This is how a ZeRO-1 shard of a parameter is described: a flat range of the local tensor
        splits into at most 2*ndim-1 rectangles, each then cut by the layout's blocks.
        """
        if flat.dim() != 1 or start < 0 or start + flat.numel() > math.prod(self.local_shape):
            raise CheckpointError(
                f"flat range [{start}, {start + flat.numel()}) is outside the local "
                f"tensor of shape {self.local_shape}"
            )
        out = []
        for rect_offsets, rect_sizes, flat_start in _flat_range_rectangles(
            self.local_shape, start, flat.numel()
        ):
            view = flat[flat_start - start : flat_start - start + math.prod(rect_sizes)].view(rect_sizes)
            for b in self.blocks:
                lo = [max(r, bo) for r, bo in zip(rect_offsets, b.local_offsets, strict=True)]
                hi = [
                    min(r + rs, bo + bs)
                    for r, rs, bo, bs in zip(rect_offsets, rect_sizes, b.local_offsets, b.sizes, strict=True)
                ]
                if any(h <= low for low, h in zip(lo, hi, strict=True)):
                    continue
                sub = _narrow(
                    view,
                    [low - r for low, r in zip(lo, rect_offsets, strict=True)],
                    [h - low for low, h in zip(lo, hi, strict=True)],
                )
                glob = tuple(
                    g + low - bo for g, low, bo in zip(b.global_offsets, lo, b.local_offsets, strict=True)
                )
                out.append(Piece(sub, glob))
        return out


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or s != tensor.shape[d]:
            tensor = tensor.narrow(d, o, s)
    return tensor


def _flat_range_rectangles(
    shape: tuple[int, ...], start: int, length: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the row-major range [start, start+length) of `shape` into rectangles contiguous in memory.

    Returns (offsets, sizes, flat_start) per rectangle, in memory order.
    """
    if not shape:
        return [((), (), 0)] if length else []
    out = []
    pos, end = start, start + length
    while pos < end:
        # The largest aligned rectangle starting at `pos`: grow over trailing dims while pos sits on
        # their boundary, then take as many rows of that width as fit before `end`.
        stride, d = 1, len(shape) - 1
        while d > 0 and pos % (stride * shape[d]) == 0 and pos + stride * shape[d] <= end:
            stride *= shape[d]
            d -= 1
        # Within dim d (block width `stride`), take rows up to the end of dim d or of the range.
        index = _unravel(pos, shape)
        rows = min(shape[d] - index[d], (end - pos) // stride)
        sizes = (1,) * d + (rows,) + tuple(shape[d + 1 :])
        out.append((index, sizes, pos))
        pos += rows * stride
    return out


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


@dataclass
class ModelTensor:
    """One unique parameter or persistent buffer of this rank's model part."""

    tensor: torch.Tensor
    layout: ParamLayout  # `writer` says whether this TP/PP replica writes it; DP replicas are decided apart
    # FSDP (zero_stage 2/3): the flat offset of this rank's shard in the TP-local tensor, and which replica
    # of the shards (hybrid sharding) this rank holds; None for a whole local tensor.
    shard_start: int | None = None
    replica: int = 0

    def pieces(self, t: torch.Tensor) -> list[Piece]:
        """Pieces of `t`, shaped like this parameter (an FSDP shard of it: the local tensor's rows)."""
        if self.shard_start is None:
            return self.layout.pieces(t)
        return self.layout.flat_pieces(local_tensor(t).reshape(-1), self.shard_start)

    def writes(self, topo: Any) -> bool:
        """Whether this rank writes its pieces: the TP/PP writer, on DP rank 0 or, when the tensor is
        sharded over DP, on the first replica of the shards."""
        if self.shard_start is None:
            return self.layout.writer and _dp_rank(topo, self.tensor) == 0
        return self.layout.writer and self.replica == 0

    def holds_origin(self) -> bool:
        """Whether this rank's pieces include element 0 of the full tensor."""
        return self.layout.holds_origin() and not self.shard_start


def named_parameters_once(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Each parameter once, under the name that says what it is: PipelineStages also registers its tied
    embedding as `tied_param`, which named_parameters lists first, so the chunk's name is kept instead
    (Muon tells embeddings from matrices by name); a tied head's second name is dropped, as
    named_parameters does."""
    named, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name != "tied_param" and id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def describe_model(model: nn.Module, topo: Any, tied: bool) -> dict[str, ModelTensor]:
    """This rank's parameters and persistent buffers under their single-process names, with layouts.

    Tied weights (`tied`: model.tied_embeddings) appear once, as embed_tokens.weight. A pipeline rank's
    chunks (`chunks.<c>.` prefixes of llmtrain.pipeline.stages.PipelineStages) keep the single-process
    names below the prefix; the last stage's copy of a tied embedding is marked `duplicate` there, so it
    reads but never writes.
    """
    tp, tp_rank = (getattr(topo, "tp", 1), getattr(topo, "tp_rank", 0)) if topo is not None else (1, 0)
    # A tensor may have several names (tied weights; PipelineStages also registers `tied_param`): take
    # the first one inside a pipeline chunk if there is one, else the first.
    names: dict[int, str] = {}
    tensors: dict[int, torch.Tensor] = {}
    for local_name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in names or (
            _CHUNK_PREFIX.match(local_name) and not _CHUNK_PREFIX.match(names[id(tensor)])
        ):
            names[id(tensor)] = local_name
        tensors[id(tensor)] = tensor
    out: dict[str, ModelTensor] = {}
    for key, local_name in names.items():
        tensor = tensors[key]
        name = _CHUNK_PREFIX.sub("", local_name)
        if tied and name == "lm_head.weight":
            name = "embed_tokens.weight"
        if name in out:
            raise CheckpointError(f"two tensors of this rank's model map to the name {name}")
        layout = tp_layout(name, tensor, tp, tp_rank)  # a DTensor's shape is the TP-local one
        layout.check(name)
        out[name] = ModelTensor(tensor, layout, *shard_position(tensor))
    return out


_CHUNK_PREFIX = re.compile(r"^chunks\.\d+\.")


def tp_layout(name: str, tensor: torch.Tensor, tp: int, tp_rank: int) -> ParamLayout:
    """Full-tensor layout of a local tensor from its `tp_layout` / `duplicate` / `expert_slice` attributes."""
    kind = getattr(tensor, "tp_layout", None)
    writer = not getattr(tensor, "duplicate", False)
    shape = tuple(tensor.shape)
    if hasattr(tensor, "expert_slice"):  # an expert-parallel shard: experts [start, start + local) of total
        start, total = tensor.expert_slice
        return ParamLayout.split((total, *shape[1:]), 0, [(start, shape[0])], writer)
    if kind is None or tp == 1:
        return ParamLayout.full(shape, writer)
    rows = shape[0]
    if kind == "rows":
        return ParamLayout.split((rows * tp, *shape[1:]), 0, [(tp_rank * rows, rows)], writer)
    if kind == "cols":
        cols = shape[-1]
        full = (*shape[:-1], cols * tp)
        return ParamLayout.split(full, len(shape) - 1, [(tp_rank * cols, cols)], writer)
    if kind == "gate_up":
        # Local rows are [gate slice; up slice]; in the full tensor gate rows come first, then up rows.
        f = rows // 2
        ffn = f * tp
        return ParamLayout.split((2 * ffn, *shape[1:]), 0, [(tp_rank * f, f), (ffn + tp_rank * f, f)], writer)
    if isinstance(kind, tuple) and kind[0] == "kv":
        replicas = kind[1]
        heads = tp // replicas
        return ParamLayout.split(
            (rows * heads, *shape[1:]), 0, [((tp_rank // replicas) * rows, rows)], writer
        )
    raise CheckpointError(
        f"parameter {name} has tp_layout={kind!r}, which this checkpoint version does not know"
    )


def _dp_rank(topo: Any, tensor: torch.Tensor | None = None) -> int:
    """This rank's index among the replicas of `tensor` (of a dense parameter if None): DP ranks, and CP
    ranks inside them; for an expert-parallel shard, the ranks holding the same experts."""
    if topo is None:
        return 0
    if tensor is not None and hasattr(tensor, "expert_slice"):
        return topo.expert_dp_rank
    return getattr(topo, "dp_cp_rank", getattr(topo, "dp_rank", 0))
