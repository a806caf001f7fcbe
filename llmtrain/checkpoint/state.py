"""What goes into a checkpoint: model and optimizer tensors as GlobalTensors, and every RNG state.

Keys are `model.<name>` and `optim.<name>.<state>` (`master` for fp32 master weights, `exp_avg`,
`exp_avg_sq`, `step` for AdamW) with `<name>` the single-process parameter name, so a checkpoint is the
same whatever (tp, pp, dp, zero_stage) wrote it.

Where a rank's pieces of the parameters sit in the full tensors (tensor-, expert- and FSDP-parallel
shards) is llmtrain.parallel.param_layout's `describe_model`. ZeRO-1 optimizer shards come from the
ModelOptimizer's flat ranges (`buffers.local_ranges()`), each a flat range of the TP-local tensor.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.storage import GlobalTensor
from llmtrain.parallel.fsdp import local_tensor
from llmtrain.parallel.optimizer import LossScaledOptimizer, ModelOptimizer
from llmtrain.parallel.param_layout import ModelTensor, Piece

MODEL = "model."
OPTIM = "optim."


def model_entries(params: dict[str, ModelTensor], topo: Any) -> dict[str, GlobalTensor]:
    """GlobalTensors over the live model tensors (for saving, or loading in place); DP rank 0 writes, or
    each rank its FSDP shard."""
    return {
        MODEL + name: GlobalTensor(m.layout.global_shape, m.pieces(m.tensor.detach()), m.writes(topo))
        for name, m in params.items()
    }


@dataclass
class _Slot:
    """One tensor a torch optimizer keys state by, and how state shaped like it maps to the full tensor."""

    key: torch.Tensor
    name: str
    global_shape: tuple[int, ...]
    pieces: Callable[[torch.Tensor], list[Piece]]
    write: bool  # writes the pieces of its state
    write_scalar: bool  # writes the parameter's scalar state (AdamW's step) for everyone


def _slots(
    optimizer: Any, params: dict[str, ModelTensor], topo: Any
) -> tuple[torch.optim.Optimizer | None, list[_Slot]]:
    """The torch optimizer inside `optimizer` and a slot per tensor it updates."""
    names = {id(m.tensor): name for name, m in params.items()}
    if isinstance(optimizer, ModelOptimizer):
        buffers = optimizer.buffers
        slots = []
        for master, (p, start, _) in zip(optimizer.masters, buffers.local_ranges(), strict=True):
            name = names[id(p)]
            layout = params[name].layout
            offset = start - buffers.offsets[p]
            # zero_stage 1: each DP rank writes the range it owns; zero_stage 0: DP rank 0 writes it all.
            first_dp = buffers.bucket_of[p].reduce.index == 0
            write = layout.writer and (buffers.zero_stage == 1 or first_dp)
            slots.append(
                _Slot(
                    master,
                    name,
                    layout.global_shape,
                    lambda t, layout=layout, offset=offset: layout.flat_pieces(t, offset),
                    write,
                    write and offset == 0 and layout.holds_origin(),
                )
            )
        return optimizer.optimizer, slots
    if isinstance(optimizer, LossScaledOptimizer):
        # FSDPOptimizer: a torch optimizer over the model's own (sharded) parameters.
        optimizer = optimizer.optimizer
        if optimizer is None:
            return None, []
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: expected "
            "llmtrain.parallel.ModelOptimizer or a torch.optim.Optimizer"
        )
    slots = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in "
                    "the model; build the optimizer over model.parameters()"
                )
            m = params[names[id(p)]]
            write = m.writes(topo)
            origin = write and m.holds_origin()
            slots.append(_Slot(p, names[id(p)], m.layout.global_shape, m.pieces, write, origin))
    return optimizer, slots


def optimizer_entries(optimizer: Any, params: dict[str, ModelTensor], topo: Any) -> dict[str, GlobalTensor]:
    """GlobalTensors over the optimizer's state (and fp32 master weights when they are separate)."""
    opt, slots = _slots(optimizer, params, topo)
    out: dict[str, GlobalTensor] = {}

    def add(fqn: str, shape: tuple[int, ...], pieces: list[Piece], write: bool) -> None:
        entry = out.setdefault(fqn, GlobalTensor(shape, [], write))
        entry.pieces.extend(pieces)

    separate_master = isinstance(optimizer, ModelOptimizer) and optimizer.master_flat is not None
    for slot in slots:
        if separate_master:
            add(f"{OPTIM}{slot.name}.master", slot.global_shape, slot.pieces(slot.key.detach()), slot.write)
        state = opt.state.get(slot.key, {}) if opt is not None else {}
        for key, value in state.items():
            fqn = f"{OPTIM}{slot.name}.{key}"
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {key!r} of {slot.name} is a {type(value).__name__}; "
                    "only tensors are supported"
                )
            if value.dim() == 0:
                if slot.write_scalar or fqn not in out:
                    out[fqn] = GlobalTensor((), [Piece(value.detach(), ())], slot.write_scalar)
            else:
                add(fqn, slot.global_shape, slot.pieces(value.detach()), slot.write)
    return out


def optimizer_scalars(optimizer: Any) -> dict[str, Any]:
    """Optimizer state outside tensors: param-group hyperparameters, fp16 loss scale."""
    if isinstance(optimizer, LossScaledOptimizer):
        return optimizer.scalar_state()
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def optimizer_targets(
    optimizer: Any, params: dict[str, ModelTensor], topo: Any, metadata: Metadata
) -> tuple[dict[str, GlobalTensor], Callable[[dict[str, Any]], None]]:
    """Entries to read the optimizer state into, and the function that installs it once read."""
    opt, slots = _slots(optimizer, params, topo)
    saved = metadata.state_dict_metadata
    entries: dict[str, GlobalTensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    separate_master = isinstance(optimizer, ModelOptimizer) and optimizer.master_flat is not None
    # torch's optimizer state_dict numbers tensors in param-group order.
    index_of = {
        id(p): i for i, p in enumerate(p for g in (opt.param_groups if opt else []) for p in g["params"])
    }
    for slot in slots:
        if separate_master:
            # fp32 masters from the checkpoint's masters, or from its model weights if it had none (fp32 run).
            source = f"{OPTIM}{slot.name}.master"
            source = source if source in saved else MODEL + slot.name
            entries.setdefault(source, GlobalTensor(slot.global_shape, [])).pieces.extend(
                slot.pieces(slot.key.detach())
            )
        prefix = f"{OPTIM}{slot.name}."
        for fqn, md in saved.items():
            key = fqn[len(prefix) :]
            if (
                not fqn.startswith(prefix)
                or "." in key
                or key == "master"
                or not isinstance(md, TensorStorageMetadata)
            ):
                continue
            if tuple(md.size) == ():
                t = torch.empty((), dtype=md.properties.dtype)
                pieces = [Piece(t, ())]
            else:
                if tuple(md.size) != slot.global_shape:
                    raise CheckpointError(
                        f"optimizer state {fqn} has shape {tuple(md.size)} in the checkpoint "
                        f"but its parameter has {slot.global_shape}"
                    )
                local = local_tensor(slot.key)
                t = torch.empty(local.shape, dtype=md.properties.dtype, device=local.device)
                pieces = slot.pieces(t)
            entries.setdefault(fqn, GlobalTensor(tuple(md.size), [])).pieces.extend(pieces)
            state.setdefault(index_of[id(slot.key)], {})[key] = _like(t, slot.key)

    def install(scalars: dict[str, Any]) -> None:
        if isinstance(optimizer, ModelOptimizer):
            if optimizer.master_flat is not None and optimizer.masters:
                torch._foreach_copy_(optimizer.param_views, optimizer.masters)
        if isinstance(optimizer, LossScaledOptimizer):
            optimizer.load_scalar_state(scalars)
        if opt is None:
            return
        groups = opt.state_dict()["param_groups"]
        saved_groups = scalars.get("param_groups")
        if saved_groups is not None and len(saved_groups) == len(groups):
            groups = [{**s, "params": g["params"]} for s, g in zip(saved_groups, groups, strict=True)]
        opt.load_state_dict({"state": state, "param_groups": groups})

    return entries, install


def _like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """State read into a local tensor `t`, as the optimizer keeps it for `param` (a DTensor for an FSDP
    shard, placed like the parameter)."""
    if not isinstance(param, DTensor) or t.dim() == 0:
        return t
    return DTensor.from_local(
        t, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def capture_rng(model: nn.Module) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch, CUDA if initialised, the TP dropout tracker)."""
    version, keys, gauss = random.getstate()
    kind, np_keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(keys), gauss],
        "numpy": [kind, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = getattr(model, "tp_rng", None)
    if tracker is not None:
        state["tp_tracker"] = tracker.get_states()
    return state


def restore_rng(state: dict[str, Any], model: nn.Module) -> None:
    """Inverse of capture_rng."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = getattr(model, "tp_rng", None)
    if tracker is not None and "tp_tracker" in state:
        tracker.set_states(state["tp_tracker"])
