"""Activation recomputation: selective (attention core) or full (whole transformer blocks)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmtrain.parallel.random import RNGTracker

MODES = ("none", "selective", "full")


def _recomputed(fn: Callable[..., Any], tracker: RNGTracker | None) -> Callable[..., Any]:
    """`fn` run under torch's checkpoint; the TP RNG tracker is rewound for the recomputation too.

    torch's checkpoint restores the default RNG so dropout masks repeat; dropout under the TP tracker
    draws from the tracker's own states, which must be rewound to where the forward found them.
    """

    def call(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args)  # evaluation: nothing is saved, so there is nothing to recompute
        # Reentrant checkpoint keeps its inputs through save_for_backward, so saved-tensor hooks see them.
        if tracker is None:
            # No tracker state to rewind: fn itself, with no Python side effect torch.compile would have
            # to break the graph for (the body below mutates `first`; a compiled block broke around every
            # checkpoint: 67 ms of host gaps a LLaMA-3B step on an H200).
            return checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=True)
        snapshot = tracker.get_states()
        first = [True]

        def body(*inner: Any) -> Any:
            if not first[0]:
                after = tracker.get_states()
                tracker.set_states(snapshot)
                try:
                    return fn(*inner)
                finally:
                    tracker.set_states(after)
            first[0] = False
            return fn(*inner)

        return checkpoint(body, *args, use_reentrant=True, preserve_rng_state=True)

    return functools.wraps(fn)(call)


def apply_recompute(model: nn.Module, mode: str, per_layer: Sequence[str] = ()) -> nn.Module:
    """Wrap each block (full) or each attention core (selective) in activation checkpointing, in place;
    `per_layer` (model.recompute_layers: one mode per block), when given, replaces the uniform `mode`."""
    modes = list(per_layer) or [mode] * len(model.layers)
    if len(modes) != len(model.layers):
        raise ValueError(f"model.recompute_layers has {len(modes)} entries for {len(model.layers)} layers")
    for m in dict.fromkeys(modes):
        if m not in MODES:
            raise ValueError(f"model.recompute must be one of {', '.join(MODES)}; got {m!r}")
    tracker = getattr(model, "tp_rng", None)
    # The multi-token prediction blocks (model.blocks() past the layers) follow the uniform `mode`.
    blocks = model.blocks()
    modes += [mode] * (len(blocks) - len(modes))
    for block, m in zip(blocks, modes, strict=True):
        if m == "full":
            block.forward = _recomputed(block.forward, tracker)
        elif m == "selective":
            block.attn.core = _recomputed(block.attn.core, tracker)
    return model


def saved_activation_bytes(fn: Callable[[], Any], exclude: list[torch.Tensor] | tuple = ()) -> int:
    """Bytes of distinct storages saved for backward while `fn()` runs (storages of `exclude` not counted)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
