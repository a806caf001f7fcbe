"""RMSNorm and LayerNorm in Triton: fp32 statistics, optional fused residual add, two-stage weight grads.

Forward: one program normalises BLOCK_M rows of the (rows, hidden) view; with a residual it first forms
h = x + residual (rounded to x's dtype, as the eager model would) and stores h as the new residual stream.
Backward: a persistent grid; each program walks its share of the rows, writes dx and accumulates the
weight (and bias) gradient of its rows in fp32 into its own row of a (programs, hidden) buffer, which
is summed afterwards (the two-stage reduction, no atomics).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, compiled_as_op, launch_layout, num_programs, tuned
from kernels.autograd_inputs import apply_distinct

MAX_HIDDEN = 65536


@triton.jit
def _norm_fwd_kernel(
    X,
    R,
    W,
    B,
    Y,
    H,
    MEAN,
    RSTD,
    M,
    N,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    eps,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    # EVEN_N (hidden == BLOCK_N): no column mask, so loads and stores vectorise along the row.
    col_ok = (cols < N) | EVEN_N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x_raw = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(x_raw.dtype)
        tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    if IS_RMS:
        var = tl.sum(x * x, axis=1) / N
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        tl.store(MEAN + rows, mean, mask=row_ok)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + tl.cast(eps, tl.float32))  # torch.compile passes Python floats as fp64
    tl.store(RSTD + rows, rstd, mask=row_ok)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    xhat = xc * rstd[:, None]
    if IS_RMS:
        # Hugging Face rounds the normalised activations to the input dtype before scaling.
        xhat = xhat.to(x_raw.dtype).to(tl.float32)
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X,
    W,
    DY,
    DH,
    DX,
    MEAN,
    RSTD,
    DW_PART,
    DB_PART,
    M,
    N,
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    rows_per_program,
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = (cols < N) | EVEN_N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, M)
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DH:
            # The new residual stream h feeds later layers too: its gradient joins the norm's.
            dx += tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    tl.store(DW_PART + pid * N + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, db_acc, mask=col_ok)


def _block_sizes(n: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(n)
    # Keep a tile at about 4k-16k elements: several rows per program for narrow hidden sizes.
    block_m = max(1, min(16, 8192 // block_n))
    num_warps = min(max(block_n * block_m // 1024, 1), 16)
    return block_m, block_n, num_warps


def _variants(block_n: int) -> list[tuple[int, int]]:
    """(rows per tile, warps): the heuristic first (the interpreter runs only it), then a few neighbours
    that CUDA autotunes over, once per hidden size."""
    block_m, _, warps = _block_sizes(block_n)
    pairs = [(block_m, warps), (max(1, block_m // 2), warps), (block_m, min(16, 2 * warps))]
    pairs += [(2 * block_m, min(16, 2 * warps)), (block_m, max(1, warps // 2))]
    return list(dict.fromkeys(pairs))  # drop duplicates, keep the order


def _tuned_by_block_n(kernel: triton.JITFunction, key: list[str]) -> dict[int, Callable]:
    # Built at import for every power-of-two hidden block, so launching is a plain dict lookup (no
    # object is created while torch.compile traces the autograd.Function).
    return {
        1 << i: tuned(kernel, [triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in _variants(1 << i)], key)
        for i in range(MAX_HIDDEN.bit_length())
    }


# Every output of both kernels is overwritten by each launch (dw/db partials: one full row per program),
# so autotuning may rerun them. The backward's persistent grid and rows per program come from the
# heuristic tile; a tuned tile that does not divide them ends with a masked partial tile.
_FWD = _tuned_by_block_n(_norm_fwd_kernel, ["N", "IS_RMS", "HAS_RES", "HAS_BIAS"])
_BWD = _tuned_by_block_n(_norm_bwd_kernel, ["N", "IS_RMS", "HAS_DH", "HAS_BIAS"])


def _forward_shapes(x2, residual2, weight, bias, eps, is_rms):
    m, n = x2.shape
    y = x2.new_empty((m, n), dtype=torch.promote_types(x2.dtype, weight.dtype) if is_rms else x2.dtype)
    h = x2.new_empty((m, n) if residual2 is not None else (0, n))
    stats = x2.new_empty(m if not is_rms else 1, dtype=torch.float32), x2.new_empty(m, dtype=torch.float32)
    return y, h, *stats


@compiled_as_op("norm_forward", _forward_shapes)
def _forward(
    x2: torch.Tensor,
    residual2: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel over (rows, hidden): (y, h, mean, rstd); h = x + residual when a residual is
    given, else an empty (0, hidden) tensor (x itself is h, and an op's outputs never alias its inputs)."""
    x2 = launch_layout(x2)
    y, h, mean, rstd = _forward_shapes(x2, residual2, weight, bias, eps, is_rms)
    r2 = launch_layout(residual2) if residual2 is not None else x2
    m, n = x2.shape
    block_n = triton.next_power_of_2(n)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)
    _FWD[block_n](x2.device)[grid](
        x2,
        r2,
        weight,
        bias if bias is not None else weight,
        y,
        h if residual2 is not None else x2,
        mean,
        rstd,
        m,
        n,
        x2.stride(0),
        r2.stride(0),
        y.stride(0),
        h.stride(0) if residual2 is not None else x2.stride(0),
        eps,
        IS_RMS=is_rms,
        HAS_RES=residual2 is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        EVEN_N=n == block_n,
    )
    return y, h, mean, rstd


def _backward_grid(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) of the persistent backward kernel."""
    block_m = _block_sizes(n)[0]
    progs = num_programs(device, triton.cdiv(m, block_m))
    rows_per_program = triton.cdiv(triton.cdiv(m, progs), block_m) * block_m
    return triton.cdiv(m, rows_per_program), rows_per_program


def _backward_shapes(h, weight, bias, dy2, dh2, mean, rstd, is_rms):
    m, n = h.shape
    progs = _backward_grid(m, n, h.device)[0]
    dw_part = h.new_empty((progs, n), dtype=torch.float32)
    db_part = h.new_empty((progs if bias is not None else 0, n), dtype=torch.float32)
    return h.new_empty((m, n)), dw_part, db_part


@compiled_as_op("norm_backward", _backward_shapes)
def _backward(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dy2: torch.Tensor,
    dh2: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel: dx (rows, hidden) and per-program partial sums of dweight and dbias (fp32;
    dbias's (0, hidden) without a bias)."""
    h, dy2 = launch_layout(h), launch_layout(dy2)
    dh2 = launch_layout(dh2) if dh2 is not None else None
    dx, dw_part, db_part = _backward_shapes(h, weight, bias, dy2, dh2, mean, rstd, is_rms)
    m, n = h.shape
    progs, rows_per_program = _backward_grid(m, n, h.device)
    block_n = triton.next_power_of_2(n)
    _BWD[block_n](h.device)[(progs,)](
        h,
        weight,
        dy2,
        dh2 if dh2 is not None else dy2,
        dx,
        mean,
        rstd,
        dw_part,
        db_part if bias is not None else dw_part,
        m,
        n,
        h.stride(0),
        dy2.stride(0),
        dh2.stride(0) if dh2 is not None else 0,
        dx.stride(0),
        rows_per_program,
        IS_RMS=is_rms,
        HAS_DH=dh2 is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        EVEN_N=n == block_n,
    )
    return dx, dw_part, db_part


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms):
        x2 = x.reshape(-1, x.shape[-1])
        r2 = residual.reshape(-1, x.shape[-1]) if residual is not None else None
        y, h, mean, rstd = _forward(x2, r2, weight, bias, eps, is_rms)
        h = h if residual is not None else x2
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        ctx.has_res = residual is not None
        ctx.x_shape = x.shape
        ctx.res_dtype = residual.dtype if residual is not None else None
        if residual is None:
            return y.view(x.shape)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(-1, h.shape[1])
        dh2 = dh.reshape(-1, h.shape[1]) if (ctx.has_res and dh is not None) else None
        dx, dw_part, db_part = _backward(h, weight, bias, dy2, dh2, mean, rstd, ctx.is_rms)
        dweight = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        dx = dx.view(ctx.x_shape)
        dres = dx.to(ctx.res_dtype) if ctx.has_res and ctx.needs_input_grad[3] else None
        return dx, dweight, dbias, dres, None, None


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must have shape ({n},) to match x's last dim; got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},) to match x's last dim; got {tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if n > MAX_HIDDEN:
        raise ValueError(f"triton norms support hidden sizes up to {MAX_HIDDEN}; got {n}, use impl='torch'")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm; with `residual` returns (norm(x + residual), x + residual)."""
    _check(x, weight, None, residual)
    return apply_distinct(_NormFn, x, weight, None, residual, float(eps), True)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton LayerNorm; with `residual` returns (norm(x + residual), x + residual)."""
    _check(x, weight, bias, residual)
    return apply_distinct(_NormFn, x, weight, bias, residual, float(eps), False)
