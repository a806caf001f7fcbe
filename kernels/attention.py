"""Flash attention in Triton (forward and backward): causal or full, grouped-query, fp32 accumulation.

q is (batch, q_heads, seq_q, head_dim); k and v are (batch, kv_heads, seq_k, head_dim) with q_heads a
multiple of kv_heads. Query head h reads kv head h // (q_heads // kv_heads) through pointer arithmetic,
so k/v are never repeated. The causal mask is top-left aligned (key j is visible to query i when j <= i),
the convention of torch's scaled_dot_product_attention(is_causal=True).

Forward: online softmax over key blocks in base 2; saves the output and the per-row log-sum-exp (natural
log, fp32). Backward: delta = rowsum(dO * O); one kernel per key block accumulates dK and dV over every
query head of its group (no atomics), a second kernel per query block accumulates dQ.
Under the interpreter every loaded tile is cast to fp32 first: fp16/bf16 arithmetic there is unreliable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, interpreting, tuned
from kernels.checks import check_attention_args

LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    scale_log2,
    HQ,
    GROUP,
    SQ,
    SK,
    D,
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    so_b,
    so_h,
    so_s,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # torch.compile passes Python floats to user-defined kernels as fp64 scalars; the loop-carried
    # row max must stay fp32 (Triton rejects a loop variable that changes type).
    scale_log2 = tl.cast(scale_log2, tl.float32)
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    hk = h // GROUP
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < SQ
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < SK
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        valid = col_ok[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, lse, mask=row_ok)
    tl.store(
        OUT + b * so_b + h * so_h + rows[:, None] * so_s + offs_d[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    scale,
    scale_log2,
    HQ,
    HK,
    GROUP,
    SQ,
    SK,
    D,
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sdo_b,
    sdo_h,
    sdo_s,
    sdk_b,
    sdk_h,
    sdk_s,
    sdv_b,
    sdv_h,
    sdv_s,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fp32, not the fp64 scalars torch.compile passes (see _attn_fwd_kernel).
    scale = tl.cast(scale, tl.float32)
    scale_log2 = tl.cast(scale_log2, tl.float32)
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HK).to(tl.int64)
    hk = (bh % HK).to(tl.int64)
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    col_ok = cols < SK
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo = 0
    if CAUSAL:
        # Queries before this key block cannot see it.
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sdo_b + h * sdo_h
        row_base = (b * HQ + h) * SQ
        for start_m in range(lo, SQ, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < SQ
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + rows[:, None] * sq_s + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows[:, None] * sdo_s + offs_d[None, :], mask=q_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            p = tl.exp2(s * scale_log2 - lse[:, None] * 1.4426950408889634)
            valid = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            p = tl.where(valid, p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    tl.store(
        DK + b * sdk_b + hk * sdk_h + cols[:, None] * sdk_s + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * sdv_b + hk * sdv_h + cols[:, None] * sdv_s + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    scale,
    scale_log2,
    HQ,
    GROUP,
    SQ,
    SK,
    D,
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sdo_b,
    sdo_h,
    sdo_s,
    sdq_b,
    sdq_h,
    sdq_s,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fp32, not the fp64 scalars torch.compile passes (see _attn_fwd_kernel).
    scale = tl.cast(scale, tl.float32)
    scale_log2 = tl.cast(scale_log2, tl.float32)
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    hk = h // GROUP
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < SQ
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + rows[:, None] * sdo_s + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=row_ok, other=0.0)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < SK
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.exp2(s * scale_log2 - lse[:, None] * 1.4426950408889634)
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


def _configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in pairs]


# The first config of each list is the one the interpreter runs (small blocks keep tests quick and still
# exercise several blocks and ragged tails); CUDA autotunes over all of them.
_FWD = tuned(
    _attn_fwd_kernel,
    _configs([(32, 16, 4, 1), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]),
    key=["SQ", "SK", "D", "CAUSAL"],
)
_DKDV = tuned(
    _attn_bwd_dkdv_kernel,
    _configs([(16, 32, 4, 1), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2)]),
    key=["SQ", "SK", "D", "CAUSAL"],
)
_DQ = tuned(
    _attn_bwd_dq_kernel,
    _configs([(32, 16, 4, 1), (64, 64, 4, 3), (128, 32, 8, 2), (128, 64, 8, 2)]),
    key=["SQ", "SK", "D", "CAUSAL"],
)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (no TF32) so they match an fp32 reference.
    return "ieee" if dtype == torch.float32 else "tf32"


class _FlashAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        bsz, hq, sq, dim = q.shape
        hk, sk = k.shape[1], k.shape[2]
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
        block_d = max(16, triton.next_power_of_2(dim))
        grid = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), bsz * hq)
        _FWD(q.device)[grid](
            q,
            k,
            v,
            o,
            lse,
            scale * LOG2E,
            hq,
            hq // hk,
            sq,
            sk,
            dim,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            o.stride(0),
            o.stride(1),
            o.stride(2),
            CAUSAL=causal,
            UPCAST=interpreting(),
            PRECISION=_precision(q.dtype),
            BLOCK_D=block_d,
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = _last_dim_contiguous(do)
        bsz, hq, sq, dim = q.shape
        hk, sk = k.shape[1], k.shape[2]
        delta = (o.float() * do.float()).sum(-1)
        dq = torch.empty_like(q)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        block_d = max(16, triton.next_power_of_2(dim))
        common = dict(
            CAUSAL=ctx.causal, UPCAST=interpreting(), PRECISION=_precision(q.dtype), BLOCK_D=block_d
        )
        strides = (
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            do.stride(0),
            do.stride(1),
            do.stride(2),
        )
        _DKDV(q.device)[lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), bsz * hk)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            ctx.scale,
            ctx.scale * LOG2E,
            hq,
            hk,
            hq // hk,
            sq,
            sk,
            dim,
            *strides,
            dk.stride(0),
            dk.stride(1),
            dk.stride(2),
            dv.stride(0),
            dv.stride(1),
            dv.stride(2),
            **common,
        )
        _DQ(q.device)[lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), bsz * hq)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            ctx.scale,
            ctx.scale * LOG2E,
            hq,
            hq // hk,
            sq,
            sk,
            dim,
            *strides,
            dq.stride(0),
            dq.stride(1),
            dq.stride(2),
            **common,
        )
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """Triton flash attention over (batch, heads, seq, head_dim); k/v may have fewer heads."""
    check_attention_args(q, k, v)
    check_same_device(q=q, k=k, v=v)
    if q.shape[3] > 256:
        raise ValueError(
            f"triton flash_attention supports head_dim <= 256; got {q.shape[3]}, use impl='torch'"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    return _FlashAttentionFn.apply(q, k, v, bool(causal), scale)
