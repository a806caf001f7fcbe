"""Allocating and initialising a model built on the meta device, each rank only what it holds.

The trainer builds the CausalLM under ``torch.device("meta")``; tensor parallelism and pipeline stage
splitting work on the meta tensors (no memory), then `materialize` gives every parameter its local storage
and fills it with the values of the global region it holds (llmtrain.models.init), so the result equals
slicing the single-process model built with the same seed. Which global region a local tensor holds is
read from the same description the checkpoints use (llmtrain.parallel.param_layout.describe_model).

At zero_stage 2/3 FSDP2's ``fully_shard`` is applied to the meta model first (its parameters become meta
DTensors); `materialize` then allocates each rank's shards the way FSDP2 documents it (``to_empty`` on every
sharded root, which also pads uneven shards) and fills each shard in place from the flat offset where it
starts in the TP-local tensor, so no rank ever holds a whole TP-local tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from llmtrain.config.schema import ModelConfig
from llmtrain.models.init import InitKind, fill_region, init_kinds
from llmtrain.parallel.param_layout import ParamLayout, describe_model


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (still to be materialised)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def fill_local(
    tensor: torch.Tensor,
    name: str,
    kind: InitKind,
    layout: ParamLayout,
    seed: int,
    std: float,
    flat_start: int | None = None,
) -> None:
    """Fill `tensor` with the initial values of parameter `name` it holds according to `layout` (the TP
    layout of its local tensor, from describe_model / tp_layout): the whole local tensor (shape
    layout.local_shape), or with `flat_start` a 1-D tensor holding the local tensor's flattened elements
    [flat_start, flat_start + numel) (a ZeRO shard: rows [a, b) of the local tensor start at a * row size)."""
    pieces = layout.pieces(tensor) if flat_start is None else layout.flat_pieces(tensor, flat_start)
    for piece in pieces:
        fill_region(piece.tensor, name, kind, layout.global_shape, piece.offsets, seed, std)


@torch.no_grad()
def materialize(model: nn.Module, topo: Any, cfg: ModelConfig, seed: int, device: torch.device | str) -> None:
    """Allocate every meta parameter of `model` on `device` and fill it with its initial values, in place.

    `model` is a CausalLM, or a rank's PipelineStages, whose parameters are meta tensors carrying the
    tensor-parallel attributes of llmtrain.parallel.tensor_parallel (so describe_model knows the global
    region of each); `topo` gives the TP degree and rank (None: unsharded). Parameters keep their identity
    and attributes (torch.utils.swap_tensors), so ties and references elsewhere stay valid, and each
    parameter is filled from its single-process name: the two copies of a tied embedding on the first and
    last pipeline stage come out equal. Only local storage plus one row block of one tensor is ever
    allocated. Buffers have no initial-value rule here: a meta buffer is an error. FSDP-sharded parameters
    (DTensors) are allocated as this rank's shards only (`_allocate_fsdp_shards`) and filled in place; there
    one shard is held twice for a moment (to_empty allocates a tied weight once per owning module, and
    copies an uneven shard into its padded buffer).
    """
    kinds = init_kinds(model)
    sharded = _allocate_fsdp_shards(model, device)
    for name, entry in describe_model(model, topo, cfg.tied_embeddings).items():
        meta = entry.tensor
        if id(meta) in sharded:
            shard = meta._local_tensor  # FSDP2's storage of this rank's rows: filled in place
            fill_local(
                shard.view(-1), name, kinds[id(meta)], entry.layout, seed, cfg.init_std, entry.shard_start
            )
            continue
        if not meta.is_meta:
            continue
        if id(meta) not in kinds:
            raise ValueError(f"{name} is a meta buffer; materialize initialises parameters only")
        local = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        fill_local(local, name, kinds[id(meta)], entry.layout, seed, cfg.init_std)
        attributes = dict(meta.__dict__)  # tp_layout, duplicate, ...: swap_tensors exchanges __dict__ too
        torch.utils.swap_tensors(meta, nn.Parameter(local, requires_grad=meta.requires_grad))
        meta.__dict__.update(attributes)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"materialize left meta tensors that describe_model does not list: {left}")


def _allocate_fsdp_shards(model: nn.Module, device: torch.device | str) -> set[int]:
    """Give every meta parameter under an FSDP2 root of `model` this rank's shard on `device` (uninitialised)
    and return their ids. ``to_empty`` is FSDP2's documented way (it re-registers the padded shards); its
    tensor swap drops Python attributes (tp_layout, duplicate, ...), which are put back."""
    allocated: set[int] = set()
    for root in _fsdp_roots(model):
        tensors = [*root.parameters(), *root.buffers()]
        if not any(t.is_meta for t in tensors):
            continue
        if not all(t.is_meta for t in tensors):
            raise ValueError(
                "an FSDP-sharded module is partly materialised; materialize needs it all on meta"
            )
        attributes = {id(p): dict(p.__dict__) for p in root.parameters()}
        root.to_empty(device=device)
        for p in root.parameters():
            p.__dict__.update(attributes[id(p)])
            if isinstance(p, DTensor):
                allocated.add(id(p))
    return allocated


def _fsdp_roots(module: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of `module` (the model itself, or each pipeline chunk)."""
    if isinstance(module, FSDPModule):
        return [module]
    return [root for child in module.children() for root in _fsdp_roots(child)]
