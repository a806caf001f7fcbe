"""Saved-activation bytes of one transformer layer: measured (saved-tensor hooks) vs Korthikanti."""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.parallel.recompute import saved_activation_bytes


def korthikanti_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes per layer (16-bit activations, 1-byte dropout masks) from Korthikanti et al. 2022.

    none: sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP; selective drops the 5as/h
    (attention core) term; full keeps only the layer input, 2sbh (divided by t with SP).
    """
    sbh = s * b * h
    attention = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        attention = 0.0
    if sequence_parallel:
        return sbh * (34 + attention) / t
    return sbh * (10 + 24 / t + attention / t)


def measure_layer_bytes(model: nn.Module, layer: int, batch: int, seq: int) -> int:
    """Bytes saved for backward by `model.layers[layer]` on a (batch, local seq, hidden) input.

    `seq` is the local sequence length of the layer's input (seq / tp under sequence parallelism).
    """
    block = model.layers[layer]
    param = next(model.parameters())
    x = torch.randn(
        batch, seq, model.config.hidden_size, dtype=param.dtype, device=param.device, requires_grad=True
    )
    full_seq = model.config.seq_length
    rope = model.rope(full_seq, x.device, x.dtype)
    return saved_activation_bytes(lambda: block(x, rope), exclude=list(model.parameters()))
