"""SwiGLU and GeGLU (tanh GELU) in Triton: out = act(gate) * up.

Only gate and up are saved; the backward recomputes act(gate) and its derivative in registers, so the
activation and the product never live in memory. Inputs may be column slices of one fused gate_up
projection (row stride != width): the kernel walks rows with their stride instead of copying.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, compiled_as_op, launch_layout, tuned
from kernels.autograd_inputs import apply_distinct


@triton.jit
def _act_and_grad(g, IS_GELU: tl.constexpr, NEED_GRAD: tl.constexpr):
    if IS_GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # tanh(z) = 2 * sigmoid(2z) - 1: libdevice tanh is unavailable under the interpreter.
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        act = 0.5 * g * (1.0 + t)
        if NEED_GRAD:
            dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3.0 * 0.044715 * g * g
            )
        else:
            dact = act
    else:
        sig = tl.sigmoid(g)
        act = g * sig
        if NEED_GRAD:
            dact = sig * (1.0 + g * (1.0 - sig))
        else:
            dact = act
    return act, dact


@triton.jit
def _glu_fwd_kernel(
    G,
    U,
    OUT,
    M,
    N,
    s_g,
    s_u,
    s_o,
    IS_GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # EVEN_N (N a multiple of BLOCK_N): no column mask, so loads and stores vectorise along the row.
    mask = (rows < M)[:, None] & ((cols < N) | EVEN_N)[None, :]
    g = tl.load(G + rows[:, None] * s_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * s_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(g, IS_GELU, False)
    tl.store(OUT + rows[:, None] * s_o + cols[None, :], (act * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    G,
    U,
    DO,
    DG,
    DU,
    M,
    N,
    s_g,
    s_u,
    s_do,
    s_dg,
    s_du,
    IS_GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # EVEN_N (N a multiple of BLOCK_N): no column mask, so loads and stores vectorise along the row.
    mask = (rows < M)[:, None] & ((cols < N) | EVEN_N)[None, :]
    g = tl.load(G + rows[:, None] * s_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * s_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * s_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(g, IS_GELU, True)
    tl.store(DG + rows[:, None] * s_dg + cols[None, :], (do * u * dact).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + rows[:, None] * s_du + cols[None, :], (do * act).to(DU.dtype.element_ty), mask=mask)


def _block_n(n: int) -> int:
    return min(1024, triton.next_power_of_2(n))


def _tuned_by_block_n(kernel: triton.JITFunction) -> dict[int, Callable]:
    """Per column block (a power of two up to 1024), the kernel autotuned on CUDA over rows per program and
    warps; the first config is the untuned heuristic (a 2048-element tile, 4 warps), which the interpreter
    runs. Each launch overwrites all of its outputs, so autotuning may rerun it. Built at import, so a launch
    is a plain dict lookup."""
    out = {}
    for i in range(11):
        bn = 1 << i
        bm = max(1, 2048 // bn)
        pairs = [(bm, 4), (bm, 8), (2 * bm, 8), (4 * bm, 8), (4 * bm, 16)]
        out[bn] = tuned(
            kernel, [triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in pairs], ["N", "IS_GELU"]
        )
    return out


_FWD = _tuned_by_block_n(_glu_fwd_kernel)
_BWD = _tuned_by_block_n(_glu_bwd_kernel)


def _out_shape(gate, up, is_gelu):
    m, n = gate.shape
    return gate.new_empty((m, n), dtype=torch.promote_types(gate.dtype, up.dtype))


@compiled_as_op("glu_forward", _out_shape)
def _forward(gate: torch.Tensor, up: torch.Tensor, is_gelu: bool) -> torch.Tensor:
    """act(gate) * up over (rows, n)."""
    g2, u2 = launch_layout(gate), launch_layout(up)
    out = _out_shape(g2, u2, is_gelu)
    m, n = g2.shape
    bn = _block_n(n)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, bn))
    _FWD[bn](g2.device)[grid](
        g2,
        u2,
        out,
        m,
        n,
        g2.stride(0),
        u2.stride(0),
        out.stride(0),
        IS_GELU=is_gelu,
        BLOCK_N=bn,
        EVEN_N=n % bn == 0,
    )
    return out


@compiled_as_op(
    "glu_backward", lambda gate, up, dout, is_gelu: (gate.new_empty(gate.shape), up.new_empty(up.shape))
)
def _backward(
    gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, is_gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) over (rows, n), each in its input's dtype."""
    g2, u2, d2 = launch_layout(gate), launch_layout(up), launch_layout(dout)
    m, n = g2.shape
    dg = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    du = torch.empty((m, n), dtype=up.dtype, device=up.device)
    bn = _block_n(n)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, bn))
    _BWD[bn](g2.device)[grid](
        g2,
        u2,
        d2,
        dg,
        du,
        m,
        n,
        g2.stride(0),
        u2.stride(0),
        d2.stride(0),
        dg.stride(0),
        du.stride(0),
        IS_GELU=is_gelu,
        BLOCK_N=bn,
        EVEN_N=n % bn == 0,
    )
    return dg, du


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _GluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, is_gelu):
        ctx.save_for_backward(gate, up)
        ctx.is_gelu = is_gelu
        return _forward(_rows(gate), _rows(up), is_gelu).view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = _backward(_rows(gate), _rows(up), _rows(dout), ctx.is_gelu)
        return dg.view(gate.shape), du.view(up.shape), None


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    check_same_device(gate=gate, up=up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton silu(gate) * up."""
    _check(gate, up)
    return apply_distinct(_GluFn, gate, up, False)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton gelu_tanh(gate) * up."""
    _check(gate, up)
    return apply_distinct(_GluFn, gate, up, True)
