"""Framework operators the trainer dispatches per transformer layer and micro-batch (host overhead), and
the bytes the reference path's memory-bound operators move.

Every PyTorch operator costs host time before its kernel runs: the Python call, the dispatcher, and under
autograd the recording of a backward node whose own operators are dispatched again in the backward. The cost
model charges Device.host_op_us (calibrated on a tiny op chain) for each of them. The counts are those the
model code dispatches (aten operators, views included) on the reference kernel path (model.kernels=reference,
the CPU path), counted by tests/planner/test_host_ops.py with a TorchDispatchMode on the real blocks; the
fused Triton path on CUDA dispatches fewer, so there they are an upper bound, and on a GPU host overhead is
hidden behind the kernels unless they are tiny (see CostModel._layer_costs).
"""

from __future__ import annotations

from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.collectives import PassComms

BLOCK_OPS = {True: (73, 124), False: (39, 95)}
"""(forward, backward) operators of one dense block without tensor parallelism: gated (RMSNorm, rotary,
SwiGLU: LLaMA's family) and not (LayerNorm with bias, learned positions, GELU: GPT's)."""
MODEL_EXTRA_OPS = {True: (17, 30), False: (14, 19)}
"""(forward, backward) operators of the embedding, final norm, output layer and loss of one micro-batch."""
SELECTIVE_OPS = 1
"""Operators selective recomputation re-runs in the backward: the attention core."""


REFERENCE_BACKWARD = {True: 2.28, False: 2.11}
"""The reference path's backward bytes over its forward's, gated and GPT blocks (counted by the test over
two shapes: 2.27-2.29 and 2.11-2.12; the autograd formulas re-read the saved inputs)."""


def reference_bytes(
    model: ModelConfig, tokens: float, tp: int, sp: bool, act_bytes: int
) -> tuple[float, float]:
    """(forward, backward) bytes one layer moves through memory-bound operators on the reference path
    (PyTorch ops, no fused kernels) for `tokens` tokens of a TP rank.

    Counted from the code (tests/planner/test_host_ops.py checks them with a TorchDispatchMode summing every
    non-matmul operator's inputs and outputs): gated blocks 20 per hidden element (RMSNorm: square, mean,
    two multiplies, 7 per norm; the residual adds, 6), 10 per rotated query/key element (two multiplies,
    the half rotation's negation and concatenation, the add) and 5 per MLP element (SiLU, the gating
    multiply); GPT blocks 10 per hidden element (LayerNorm reads and writes, 2 per norm; the residual adds)
    and 2 per MLP element (GELU); the backward REFERENCE_BACKWARD times as many. Hidden elements split over
    TP under sequence parallelism only."""
    h, d, f = model.hidden_size, model.head_size, model.ffn_size / tp
    hidden = tokens * h / (tp if sp else 1)
    gated = F.is_gated(model)
    if gated:
        rotated = (model.num_attention_heads + model.kv_heads) / tp * d
        fwd = act_bytes * (20 * hidden + tokens * (10 * rotated + 5 * f))
    else:
        fwd = act_bytes * (10 * hidden + 2 * tokens * f)
    return fwd, REFERENCE_BACKWARD[gated] * fwd


CE_PASSES = {"fused": (1, 2), "reference": (2, 4), "vocab_parallel": (6, 6)}
"""(forward, backward) passes over the fp32 logits of the cross-entropy: llmtrain's fused kernel (one read
in the forward; the backward's read and write); the reference F.cross_entropy (log-softmax's read and
write; the loss gradient's zero fill, then log-softmax's gradient reading it and the output and writing the
input's gradient); the reference vocabulary-parallel one (kernels/reference.py: the max, the shifted
logits' write and exp and their sum; the backward's shifted exp rewritten in place and scaled). Counted by
tests/planner/test_host_ops.py where one process runs them."""


def ce_passes(fused: bool, vocab_parallel: bool) -> tuple[int, int]:
    """(forward, backward) passes of the cross-entropy over the logits (CE_PASSES)."""
    return CE_PASSES["fused" if fused else "vocab_parallel" if vocab_parallel else "reference"]


def layer_ops(model: ModelConfig, comms: PassComms, recompute: str) -> tuple[int, int]:
    """(forward, backward) operators of one layer for one micro-batch: the block's, one more per
    collective the layer issues (`comms`, recomputation's repeats included), and the forward again in the
    backward under full recomputation and torchtitan's op-level selective recomputation (whose saved ops
    are the large kernels, not the many small ones)."""
    fwd, bwd = BLOCK_OPS[F.is_gated(model)]
    redo = {"full": fwd, "selective_op": fwd, "selective": SELECTIVE_OPS}.get(recompute, 0)
    return fwd + len(comms.fwd), bwd + redo + len(comms.bwd)


def extra_ops(model: ModelConfig) -> tuple[int, int]:
    """(forward, backward) operators of a micro-batch outside the layers (embedding, head, loss)."""
    return MODEL_EXTRA_OPS[F.is_gated(model)]
