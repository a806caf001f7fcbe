"""Argument checks shared by the Triton and PyTorch paths (no Triton import: the fallback needs none)."""

from __future__ import annotations

import torch


def check_rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int) -> None:
    """Validate shapes for apply_rotary (shared by both implementations)."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seq, heads, head_dim); got shape {tuple(x.shape)}")
    seq, dim = x.shape[1], x.shape[3]
    if dim % 2:
        raise ValueError(f"rotary needs an even head_dim; got {dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != dim:
            raise ValueError(f"{name} must be (positions, head_dim={dim}); got shape {tuple(t.shape)}")
        if t.shape[0] < position_offset + seq:
            raise ValueError(
                f"{name} has {t.shape[0]} positions but position_offset={position_offset} + seq={seq} "
                "rows are needed; build a longer table"
            )
    if position_offset < 0:
        raise ValueError(f"position_offset must be >= 0; got {position_offset}")


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate shapes for flash_attention (shared by both implementations)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim); got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if k.shape[2] == 0:
        raise ValueError("k and v must hold at least one position")


def check_ce_args(logits: torch.Tensor, target: torch.Tensor) -> None:
    """Validate shapes for cross_entropy (shared by both implementations)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits' leading dims {tuple(logits.shape[:-1])}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold integer class ids (int64); got {target.dtype}")


def check_grouped_mm_args(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    """Validate shapes for grouped_mm (shared by both implementations)."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"x must be (rows, K) and weight (groups, N, K); got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must agree on K (last dim)")
    if offsets.shape != (weight.shape[0],) or offsets.dtype != torch.int32:
        raise ValueError(
            f"offsets must be int32 of shape ({weight.shape[0]},), one cumulative row end per group; "
            f"got {offsets.dtype} {tuple(offsets.shape)}"
        )
