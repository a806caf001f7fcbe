"""Where each rank's local tensors sit inside the full (single-process) tensors.

A checkpoint never stores a layout: every piece a rank writes is described by its offsets in the
full tensor under the single-process name. A `ParamLayout` maps a rank's local tensor (of a
parameter, or anything shaped like it: gradients, Adam moments, fp32 master weights) onto the full
tensor as a set of rectangular blocks; `GlobalTensor` is what the storage layer reads and writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmtrain.checkpoint.errors import CheckpointError


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


@dataclass
class GlobalTensor:
    """The pieces of one full tensor this rank holds; `write` marks the one replica that saves them."""

    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    write: bool = True

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].tensor.dtype


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
