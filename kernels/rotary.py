"""Rotary position embedding in Triton, forward and backward, half-rotated and interleaved layouts.

out[i] = x[i] * cos[i] + sign(i) * x[p(i)] * sin[i], where p pairs dimension i with i +- head_dim/2
(NeoX / HF LLaMA) or with i ^ 1 (GPT-J / HF ERNIE-4.5), and sign(i) = -1 for the first of each pair.
The rotation is orthogonal, so the backward is the same kernel with the transposed rotation:
dx[i] = dy[i] * cos[i] - sign(i) * dy[p(i)] * sin[p(i)].
cos/sin are (positions, head_dim) tables used element by element, exactly as the PyTorch reference uses
them; row s + position_offset rotates sequence position s (sequence-parallel / pipeline shards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, compiled_as_op, launch_layout, tuned
from kernels.autograd_inputs import apply_distinct
from kernels.checks import check_rotary_args


@triton.jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    OUT,
    S,
    H,
    D,
    offset,
    sx_b,
    sx_s,
    sx_h,
    so_b,
    so_s,
    so_h,
    s_cos,
    s_sin,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN: tl.constexpr,  # D == BLOCK_D and H a multiple of BLOCK_H: no masks
):
    pid_bs = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid_bs // S
    s = pid_bs % S
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    if INTERLEAVED:
        partner = dims ^ 1
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    else:
        half = D // 2
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
    dim_ok = (dims < D) | EVEN
    mask = ((heads < H) | EVEN)[:, None] & dim_ok[None, :]
    pos = (s + offset).to(tl.int64)
    cos = tl.load(COS + pos * s_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)
    if BACKWARD:
        sin_p = tl.load(SIN + pos * s_sin + partner, mask=dim_ok, other=0.0).to(tl.float32)
        sign = -sign
    else:
        sin_p = tl.load(SIN + pos * s_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)
    base = X + b.to(tl.int64) * sx_b + s.to(tl.int64) * sx_s + heads[:, None].to(tl.int64) * sx_h
    x = tl.load(base + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + (sign * sin_p)[None, :] * xp
    obase = OUT + b.to(tl.int64) * so_b + s.to(tl.int64) * so_s + heads[:, None].to(tl.int64) * so_h
    tl.store(obase + dims[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _tuned(first_warps: int) -> Callable:
    # Blocks are fixed by the shape; CUDA autotunes the warps, the untuned heuristic first (the one the
    # interpreter runs). Each launch overwrites its whole output, so autotuning may rerun it.
    warps = dict.fromkeys([first_warps, 2, 4, 8])
    configs = [triton.Config({}, num_warps=w) for w in warps]
    return tuned(_rotary_kernel, configs, key=["H", "D", "BLOCK_H", "INTERLEAVED", "BACKWARD"])


_KERNELS = {w: _tuned(w) for w in (2, 4)}


@compiled_as_op(
    "rotary",
    lambda x, cos, sin, interleaved, offset, backward: torch.empty_like(
        x, memory_format=torch.contiguous_format
    ),
)
def _launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, offset: int, backward: bool
) -> torch.Tensor:
    x, cos, sin = launch_layout(x), launch_layout(cos), launch_layout(sin)
    bsz, seq, heads, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    grid = (bsz * seq, triton.cdiv(heads, block_h))
    _KERNELS[4 if block_h * block_d >= 2048 else 2](x.device)[grid](
        x,
        cos,
        sin,
        out,
        seq,
        heads,
        dim,
        offset,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0),
        sin.stride(0),
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        EVEN=dim == block_d and heads % block_h == 0,
    )
    return out


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, offset):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        ctx.offset = offset
        return _launch(x, cos, sin, interleaved, offset, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, ctx.interleaved, ctx.offset, True), None, None, None, None


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, position_offset: int = 0
) -> torch.Tensor:
    """Triton rotary embedding of x (batch, seq, heads, head_dim); cos/sin rows offset by position_offset."""
    check_rotary_args(x, cos, sin, position_offset)
    check_same_device(x=x, cos=cos, sin=sin)
    return apply_distinct(_RotaryFn, x, cos, sin, bool(interleaved), int(position_offset))
