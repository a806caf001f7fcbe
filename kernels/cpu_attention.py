"""Ring attention's blocks on CPU tensors by torch's fused flash-attention kernel.

aten::_scaled_dot_product_flash_attention_for_cpu returns the output and the rows' natural log-sum-exp
(b, h, n) without score-sized temporaries; its backward recomputes the probabilities from the log-sum-exp it
is given and delta = rowsum(dO * O) from the output it is given. Given the rows' final (merged) output and
log-sum-exp, it therefore returns one block's share of the whole attention's gradient, the contract of
kernels.flash_attention_block_grads. It maps query head h to kv head h // (hq / hk), so grouped-query K/V go
in as they are. Its causal mask is top-left aligned (key j visible to query i when j <= i), which is the
causal mask at equal offsets, ring attention's diagonal pairs; other offsets and document masks go in as an
additive mask in the inputs' dtype (the kernel refuses a boolean one). A row that sees no key comes back with
output 0 and log-sum-exp 0; the log-sum-exp is set to -inf, as kernels/reference.py's blocks give it, so
that a merge by log-sum-exps ignores the row. Inputs are computed in at least fp32 as in the explicit path,
so outputs, log-sum-exps and gradients come back in at least fp32 for the merge and the accumulation.
"""

from __future__ import annotations

import math

import torch


def applies(q: torch.Tensor) -> bool:
    """Whether the fused CPU kernel serves blocks of `q`'s device (every floating dtype is computed in at
    least fp32, which it supports)."""
    return q.device.type == "cpu"


def _masking(
    n: int,
    m: int,
    causal: bool,
    q_offset: int,
    k_offset: int,
    allowed: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
    """The kernel's is_causal and additive mask ((b or 1), 1, n, m) for a block of n queries at q_offset..
    and m keys at k_offset.., and the rows that see no key ((b or 1), n; None where every row sees one)."""
    if allowed is None:
        if not causal or k_offset + m - 1 <= q_offset:  # every key precedes every query: nothing hidden
            return False, None, None
        if q_offset == k_offset:
            return True, None, None
    visible = torch.ones(1, n, m, dtype=torch.bool) if allowed is None else allowed
    if causal:
        rows = torch.arange(n)[:, None] + q_offset
        visible = visible & (torch.arange(m)[None, :] + k_offset <= rows)
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, -math.inf)
    return False, additive[:, None], ~visible.any(-1)


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    q_offset: int,
    k_offset: int,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/reference.py's attention_block by the fused kernel: output (b, hq, n, d) and log-sum-exp
    (b, hq, n) in at least fp32."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    is_causal, additive, blind = _masking(q.shape[2], k.shape[2], causal, q_offset, k_offset, allowed, dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(dtype), k.to(dtype), v.to(dtype), 0.0, is_causal, attn_mask=additive, scale=softmax_scale
    )
    if blind is not None:
        lse = lse.masked_fill(blind[:, None], -math.inf)
    return out, lse


def attention_block_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    q_offset: int,
    k_offset: int,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/reference.py's attention_block_grads by the fused kernel's backward: dq (b, hq, n, d), dk and
    dv (b, hk, m, d) in at least fp32 from the rows' final log-sum-exp `lse` and output `out`."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    is_causal, additive, _ = _masking(q.shape[2], k.shape[2], causal, q_offset, k_offset, allowed, dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out.to(dtype), lse.to(dtype), 0.0, is_causal,
        attn_mask=additive, scale=softmax_scale,
    )  # fmt: skip
    return dq, dk, dv
