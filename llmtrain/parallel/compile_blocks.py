"""train.compile=blocks: torch.compile each transformer block, after recomputation and before data
parallelism, as torchtitan applies it.

One graph per block: the blocks of one model share their shapes, so one compilation serves every layer, and
the kernels' autograd Functions stay whole inside it (kernels.autograd_inputs, kernels._utils.compiled_as_op).
The embedding, the head and the loss stay eager: the fused linear cross-entropy computes its gradients in
its forward, chunk by chunk, which a graph would not make faster.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, mode: str) -> nn.Module:
    """With mode 'blocks', compile each of model.blocks() in place (compiled at its first call)."""
    if mode == "blocks":
        for block in model.blocks():
            block.compile(dynamic=False)
    return model
