"""Initial parameter values as a pure function of (seed, global parameter name, element index).

A parameter is filled by one rule (`init_kind`): norm weights 1, biases (and MoE routers' score biases) 0,
every other tensor normal(0, std), the stacked (experts, rows, cols) expert tensors included.
Normal tensors are cut along their first dimension into row blocks of about BLOCK_NUMEL elements; block
``b`` of parameter ``name`` is drawn whole, shaped ``(rows of b, *shape[1:])``, from a private generator
seeded with ``block_seed(seed, name, b)``. So any part of any tensor (a tensor-parallel slice, a pipeline
stage's layers, a ZeRO-3 shard) can be produced alone, drawing at most the blocks it overlaps, and equals
the same region of the single-process model bit for bit on the same device type. The block size and the
seed derivation are part of the contract: changing either changes every initial value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from llmtrain.models.layers import LayerNorm, RMSNorm
from llmtrain.models.moe import Router

InitKind = Literal["ones", "zeros", "normal"]

BLOCK_NUMEL = 1 << 16
"""Elements per row block of a normal-initialised tensor (at least one row): 256 KiB of fp32 drawn at once.
Small, because a region that cuts a block (a ZeRO-3 shard's ends, a TP slice's columns) draws it whole
beside the rank's own shards at startup; 2^16 keeps that transient negligible at ~1e-5 s of seeding per
block (a 70B model is 1M blocks in all, spread over the ranks)."""


def init_kind(module: nn.Module, attr: str) -> InitKind:
    """How parameter `attr` of `module` starts: norm weights 1, biases 0, others normal(0, init_std).
    A router's score bias counts as a bias (ERNIE starts it at 0, and training leaves it there)."""
    if attr == "weight" and isinstance(module, (RMSNorm, LayerNorm)):
        return "ones"
    if attr == "bias" or (attr == "score_bias" and isinstance(module, Router)):
        return "zeros"
    return "normal"


def init_kinds(model: nn.Module) -> dict[int, InitKind]:
    """`init_kind` of every parameter of `model`, keyed by id(parameter) (a shared one is asked once per owner
    and must get the same answer from each)."""
    kinds: dict[int, InitKind] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            kind = init_kind(module, attr)
            if kinds.setdefault(id(p), kind) != kind:
                raise ValueError(
                    f"parameter {module_name}.{attr} is shared by modules that initialise it differently "
                    f"({kinds[id(p)]} and {kind})"
                )
    return kinds


def block_seed(seed: int, name: str, block: int) -> int:
    """The 64-bit generator seed of row block `block` of parameter `name` (stable across processes and
    Python versions, unlike hash())."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rows_per_block(global_shape: Sequence[int]) -> int:
    """Rows of the full tensor drawn together: BLOCK_NUMEL elements' worth, at least one row."""
    return max(1, BLOCK_NUMEL // max(1, math.prod(global_shape[1:])))


@torch.no_grad()
def fill_region(
    out: torch.Tensor,
    name: str,
    kind: InitKind,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    seed: int,
    std: float,
) -> None:
    """Fill `out` with the initial values of the region of parameter `name` (full shape `global_shape`)
    that starts at `offsets` and has out's shape. Draws only the row blocks the region overlaps, one at a
    time; a meta `out` is left as it is."""
    global_shape, offsets = tuple(global_shape), tuple(offsets)
    if len(offsets) != len(global_shape) or out.dim() != len(global_shape):
        raise ValueError(
            f"{name}: a region of {out.dim()} dims at offsets {offsets} of a {len(global_shape)}-dim tensor"
        )
    if any(o < 0 or o + s > g for o, s, g in zip(offsets, out.shape, global_shape, strict=True)):
        raise ValueError(f"{name}: region {tuple(out.shape)} at {offsets} leaves the full {global_shape}")
    if out.is_meta:
        return
    if kind == "ones":
        out.fill_(1.0)
        return
    if kind == "zeros":
        out.zero_()
        return
    if kind != "normal":
        raise ValueError(f"{name}: unknown init kind {kind!r}; expected ones, zeros or normal")
    if not global_shape:  # a scalar is one row of one element
        fill_region(out.view(1), name, kind, (1,), (0,), seed, std)
        return
    rows, first = global_shape[0], offsets[0]
    last = first + out.shape[0]
    per_block = rows_per_block(global_shape)
    # Whole rows of the full tensor: a block lying inside `out` can be drawn straight into it.
    whole_rows = out.shape[1:] == global_shape[1:] and out.is_contiguous() and out.dtype == torch.float32
    generator = torch.Generator(device=out.device)
    for block in range(first // per_block, -(-last // per_block)):
        start, stop = block * per_block, min(rows, (block + 1) * per_block)
        generator.manual_seed(block_seed(seed, name, block))
        if whole_rows and first <= start and stop <= last:
            out[start - first : stop - first].normal_(0.0, std, generator=generator)
            continue
        drawn = torch.empty((stop - start, *global_shape[1:]), dtype=torch.float32, device=out.device)
        drawn.normal_(0.0, std, generator=generator)
        lo, hi = max(start, first), min(stop, last)
        part = drawn[lo - start : hi - start]
        for dim in range(1, len(global_shape)):
            part = part.narrow(dim, offsets[dim], out.shape[dim])
        out[lo - first : hi - first].copy_(part)
        del drawn, part  # freed before the next block is drawn: one block at a time


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Fill every parameter of an unsharded model (names as in `named_parameters()`) by `fill_region`."""
    kinds = init_kinds(model)
    for name, p in model.named_parameters():
        fill_region(p, name, kinds[id(p)], p.shape, (0,) * p.dim(), seed, std)
