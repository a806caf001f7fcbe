"""Grouped GEMM in Triton: rows split into contiguous groups (one per expert), each multiplied by its own
weight, y[rows of group e] = x[rows of group e] @ weight[e]^T, for any number of rows per group (0 included).

Group boundaries live in a device tensor, so no launch waits on the host for the counts: the forward grid
has cdiv(rows, BLOCK_M) + groups row tiles (the most a split into that many groups can need), each program
finds its group by walking the boundaries, and programs past the last tile exit. The backward is the same
kernel for dX = dY @ weight[e] (weight read through transposed strides) and a second one for
dW[e] = dY_e^T @ X_e, one program per (group, N tile, K tile) reducing over the group's rows; an empty group
gets a zero gradient. Products accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, compiled_as_op, interpreting, launch_layout, tuned
from kernels.autograd_inputs import apply_distinct


@triton.jit
def _find_tile(BOUNDS, pid, E, BLOCK_M: tl.constexpr):
    """(group, first row, end row) of row tile `pid`; group -1 when pid is past the last tile."""
    zero = pid * 0
    group, r0, r1, tiles = zero - 1, zero, zero, zero
    start = tl.load(BOUNDS)
    for e in range(E):
        end = tl.load(BOUNDS + e + 1)
        n = tl.cdiv(end - start, BLOCK_M)
        hit = (pid >= tiles) & (pid < tiles + n)
        group = tl.where(hit, e, group)
        r0 = tl.where(hit, start + (pid - tiles) * BLOCK_M, r0)
        r1 = tl.where(hit, end, r1)
        tiles += n
        start = end
    return group, r0, r1


@triton.jit
def _gmm_kernel(
    X,
    W,
    Y,
    BOUNDS,
    E,
    N,
    K,
    s_xm,
    s_we,
    s_wn,
    s_wk,
    s_ym,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    group, r0, r1 = _find_tile(BOUNDS, tl.program_id(0), E, BLOCK_M)
    if group >= 0:
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < r1, cols < N
        w_base = W + group.to(tl.int64) * s_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                X + rows[:, None] * s_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                w_base + cols[:, None] * s_wn + ks[None, :] * s_wk,
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        tl.store(
            Y + rows[:, None] * s_ym + cols[None, :],
            acc.to(Y.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _gmm_dw_kernel(
    DY,
    X,
    DW,
    BOUNDS,
    N,
    K,
    s_dym,
    s_xm,
    s_dwe,
    s_dwn,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok, k_ok = cols < N, ks < K
    start = tl.load(BOUNDS + e)
    end = tl.load(BOUNDS + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        dy = tl.load(
            DY + rows[:, None] * s_dym + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        )
        x = tl.load(X + rows[:, None] * s_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    dw = DW + e.to(tl.int64) * s_dwe + cols[:, None] * s_dwn + ks[None, :]
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=col_ok[:, None] & k_ok[None, :])


def _configs(triples: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for m, n, k, w, s in triples
    ]


# The first config is what the interpreter runs: the smallest tiles tl.dot takes, so tiny test shapes
# still cross tile edges. Each launch overwrites all of its outputs, so autotuning may rerun it.
_GMM = tuned(
    _gmm_kernel,
    _configs([(16, 16, 16, 4, 1), (64, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3)]),
    key=["N", "K"],
)
_GMM_DW = tuned(
    _gmm_dw_kernel,
    _configs([(16, 16, 16, 4, 1), (32, 64, 64, 4, 3), (64, 128, 64, 8, 3), (32, 128, 128, 8, 3)]),
    key=["N", "K"],
)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (no TF32) so they match an fp32 reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _bounds(offsets: torch.Tensor) -> torch.Tensor:
    """int32 (groups + 1,) group boundaries: 0 followed by the cumulative row offsets."""
    return torch.cat((offsets.new_zeros(1), offsets)).to(torch.int32)


def _mm_shape(x, weight, bounds, transpose_weight):
    return x.new_empty((x.shape[0], weight.shape[2] if transpose_weight else weight.shape[1]))


@compiled_as_op("grouped_mm", _mm_shape)
def _mm(x: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, transpose_weight: bool) -> torch.Tensor:
    """x (M, K) grouped times weight[e]^T (weight (E, N, K)), or times weight[e] (weight (E, K, N))."""
    x = launch_layout(x)
    e, m = weight.shape[0], x.shape[0]
    s_we, s_a, s_b = weight.stride()
    n, k = (weight.shape[2], weight.shape[1]) if transpose_weight else (weight.shape[1], weight.shape[2])
    s_wn, s_wk = (s_b, s_a) if transpose_weight else (s_a, s_b)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) + e, triton.cdiv(n, meta["BLOCK_N"]))
    _GMM(x.device)[grid](
        x,
        weight,
        y,
        bounds,
        e,
        n,
        k,
        x.stride(0),
        s_we,
        s_wn,
        s_wk,
        y.stride(0),
        UPCAST=interpreting(),
        PRECISION=_precision(x.dtype),
    )
    return y


@compiled_as_op(
    "grouped_mm_weight_grad",
    lambda dy, x, bounds, groups: x.new_empty((groups, dy.shape[1], x.shape[1])),
)
def _mm_dw(dy: torch.Tensor, x: torch.Tensor, bounds: torch.Tensor, groups: int) -> torch.Tensor:
    """(E, N, K) per-group dY_e^T @ X_e."""
    dy, x = launch_layout(dy), launch_layout(x)
    n, k = dy.shape[1], x.shape[1]
    dw = torch.empty((groups, n, k), dtype=x.dtype, device=x.device)
    grid = lambda meta: (groups, triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]))
    _GMM_DW(x.device)[grid](
        dy,
        x,
        dw,
        bounds,
        n,
        k,
        dy.stride(0),
        x.stride(0),
        dw.stride(0),
        dw.stride(1),
        UPCAST=interpreting(),
        PRECISION=_precision(x.dtype),
    )
    return dw


class _GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        bounds = _bounds(offsets)
        ctx.save_for_backward(x, weight, bounds)
        return _mm(x, weight, bounds, transpose_weight=False)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bounds = ctx.saved_tensors
        dx = _mm(dy, weight, bounds, transpose_weight=True) if ctx.needs_input_grad[0] else None
        dw = _mm_dw(dy, x, bounds, weight.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton grouped x @ weight[e]^T (see kernels.grouped_mm)."""
    check_same_device(x=x, weight=weight, offsets=offsets)
    return apply_distinct(_GroupedMMFn, x, weight, offsets)
