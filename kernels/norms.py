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

from kernels._utils import check_same_device, launch_layout, num_programs, tuned

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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, hidden) view with unit stride along hidden; copies only when it must."""
    return launch_layout(t.reshape(-1, t.shape[-1]))


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


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms):
        n = x.shape[-1]
        x2 = _rows(x)
        m = x2.shape[0]
        out_dtype = torch.promote_types(x.dtype, weight.dtype) if is_rms else x.dtype
        y = torch.empty((m, n), dtype=out_dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        mean = torch.empty(m if not is_rms else 1, dtype=torch.float32, device=x.device)
        if residual is not None:
            r2 = _rows(residual)
            h = torch.empty((m, n), dtype=x.dtype, device=x.device)
        else:
            r2, h = x2, x2
        block_n = triton.next_power_of_2(n)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)
        _FWD[block_n](x.device)[grid](
            x2,
            r2,
            weight,
            bias if bias is not None else weight,
            y,
            h,
            mean,
            rstd,
            m,
            n,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            h.stride(0),
            eps,
            IS_RMS=is_rms,
            HAS_RES=residual is not None,
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            EVEN_N=n == block_n,
        )
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
        m, n = h.shape
        dy2 = _rows(dy)
        dh2 = _rows(dh) if (ctx.has_res and dh is not None) else None
        dx = torch.empty((m, n), dtype=h.dtype, device=h.device)
        block_m, block_n, _ = _block_sizes(n)
        progs = num_programs(h.device, triton.cdiv(m, block_m))
        rows_per_program = triton.cdiv(triton.cdiv(m, progs), block_m) * block_m
        progs = triton.cdiv(m, rows_per_program)
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=h.device)
        db_part = (
            torch.empty((progs, n), dtype=torch.float32, device=h.device) if bias is not None else dw_part
        )
        _BWD[block_n](h.device)[(progs,)](
            h,
            weight,
            dy2,
            dh2 if dh2 is not None else dy2,
            dx,
            mean,
            rstd,
            dw_part,
            db_part,
            m,
            n,
            h.stride(0),
            dy2.stride(0),
            dh2.stride(0) if dh2 is not None else 0,
            dx.stride(0),
            rows_per_program,
            IS_RMS=ctx.is_rms,
            HAS_DH=dh2 is not None,
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            EVEN_N=n == block_n,
        )
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
    return _NormFn.apply(x, weight, None, residual, float(eps), True)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton LayerNorm; with `residual` returns (norm(x + residual), x + residual)."""
    _check(x, weight, bias, residual)
    return _NormFn.apply(x, weight, bias, residual, float(eps), False)
