"""Flash attention in Triton (forward and backward): causal or full, grouped-query, fp32 accumulation.

q is (batch, q_heads, seq_q, head_dim); k and v are (batch, kv_heads, seq_k, head_dim) with q_heads a
multiple of kv_heads. Query head h reads kv head h // (q_heads // kv_heads) through pointer arithmetic,
so k/v are never repeated. The causal mask is top-left aligned (key j is visible to query i when j <= i),
the convention of torch's scaled_dot_product_attention(is_causal=True).

Forward: online softmax over key blocks in base 2; saves the output and the per-row log-sum-exp (natural
log, fp32). Backward: delta = rowsum(dO * O) by a small kernel; one kernel per key block accumulates dK and
dV over every query head of its group (no atomics), a second kernel per query block accumulates dQ.

Every loop over blocks runs in stages: the blocks no mask can touch (fully visible to the causal mask,
inside both sequence lengths) load and multiply without any masking, and only the few blocks on the
diagonal or at a ragged tail pay for masks. The backward kernels compute transposed tiles directly
(S^T = K Q^T, dS^T) from transposed loads, so no tile computed in registers is ever transposed before a
matrix product: the GEMM operands all come from memory.
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
def _load(ptrs, mask, HAS_MASK: tl.constexpr):
    """tl.load with `mask` (zeros where false) when HAS_MASK, a plain unmasked load otherwise."""
    if HAS_MASK:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _fwd_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    rows,
    offs_n,
    offs_d,
    d_ok,
    start,
    end,
    SK,
    sk_s,
    sv_s,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key blocks [start, end) of one query block's online softmax; MASKED blocks apply the causal and
    sequence-length masks, the others are known to be fully visible and in range."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kv_mask = (cols < SK)[:, None] & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k = _load(k_base + cols[:, None] * sk_s + offs_d[None, :], kv_mask, MASKED or not EVEN_D)
        v = _load(v_base + cols[:, None] * sv_s + offs_d[None, :], kv_mask, MASKED or not EVEN_D)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            valid = (cols < SK)[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            s = tl.where(valid, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # Scale the row max, not the tile, then one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Accumulate into acc inside the matrix product (no separate product tile and add).
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
    EVEN_D: tl.constexpr,
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
    # Unmasked: whole key blocks before this query block's first row (causal) and inside SK.
    full = (SK // BLOCK_N) * BLOCK_N
    hi = SK
    if CAUSAL:
        full = tl.minimum(full, (start_m * BLOCK_M // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, rows, offs_n, offs_d, d_ok, 0, full, SK, sk_s, sv_s,
        scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, rows, offs_n, offs_d, d_ok, full, hi, SK, sk_s, sv_s,
        scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, lse, mask=row_ok)
    tl.store(
        OUT + b * so_b + h * so_h + rows[:, None] * so_s + offs_d[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _attn_bwd_delta_kernel(
    OUT, DO, DELTA, HQ, SQ, D, so_b, so_h, so_s, sdo_b, sdo_h, sdo_s, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d O[b, h, i, d] * dO[b, h, i, d] in fp32 (the softmax backward's row term)."""
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < SQ)[:, None] & (offs_d < D)[None, :]
    o = tl.load(OUT + b * so_b + h * so_h + rows[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + rows[:, None] * sdo_s + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * SQ + rows, delta, mask=rows < SQ)


@triton.jit
def _dkdv_blocks(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    cols,
    offs_m,
    offs_d,
    d_ok,
    start,
    end,
    SQ,
    sq_s,
    sdo_s,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Query blocks [start, end) of one key block's dK/dV, in transposed form: S^T = K Q^T (keys x
    queries), so dV += P^T dO and dK += dS^T Q take their operands straight from memory. Query rows past
    SQ load as zeros (dO = 0 makes their P^T dO and dS^T vanish); MASKED blocks also apply the causal mask."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < SQ
        if MASKED:
            qt_mask = d_ok[:, None] & row_ok[None, :]
            do_mask = row_ok[:, None] & d_ok[None, :]
        else:
            qt_mask = d_ok[:, None]
            do_mask = d_ok[None, :]
        qt = _load(q_base + offs_d[:, None] + rows[None, :] * sq_s, qt_mask, MASKED or not EVEN_D)
        do = _load(do_base + rows[:, None] * sdo_s + offs_d[None, :], do_mask, MASKED or not EVEN_D)
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        lse_log2 = _load(lse_base + rows, row_ok, MASKED) * 1.4426950408889634
        delta = _load(delta_base + rows, row_ok, MASKED)
        st = tl.dot(k, qt, input_precision=PRECISION)
        pt = tl.exp2(st * scale_log2 - lse_log2[None, :])
        if MASKED and CAUSAL:
            pt = tl.where(cols[:, None] <= rows[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


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
    EVEN_D: tl.constexpr,
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
    # Keys past SK load as zeros; their dK/dV rows are computed but never stored.
    kv_mask = (cols < SK)[:, None] & d_ok[None, :]
    k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Query blocks: [lo, mid) straddle the causal diagonal (masked), [mid, full) see every key of this
    # block and lie inside SQ (unmasked), [max(mid, full), SQ) is the ragged tail (masked).
    lo = 0
    mid = 0
    if CAUSAL:
        # Queries before this key block cannot see it; from the first query block starting at or after
        # the block's last key, every query sees every key.
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M, tl.cdiv(SQ, BLOCK_M) * BLOCK_M)
    full = tl.maximum((SQ // BLOCK_M) * BLOCK_M, mid)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sdo_b + h * sdo_h
        lse_base = LSE + (b * HQ + h) * SQ
        delta_base = DELTA + (b * HQ + h) * SQ
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, lo, mid, SQ,
            sq_s, sdo_s, scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, mid, full, SQ,
            sq_s, sdo_s, scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, full, SQ, SQ,
            sq_s, sdo_s, scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
        )  # fmt: skip
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
def _dq_blocks(
    dq,
    q,
    do,
    lse_log2,
    delta,
    k_base,
    v_base,
    rows,
    offs_n,
    offs_d,
    d_ok,
    start,
    end,
    SK,
    sk_s,
    sv_s,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key blocks [start, end) of one query block's dQ += dS K, with K^T and V^T loaded transposed.
    Keys past SK load as zeros, so their dS K vanishes; MASKED blocks apply the causal mask."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kt_mask = d_ok[:, None] & (cols < SK)[None, :]
        else:
            kt_mask = d_ok[:, None]
        kt = _load(k_base + offs_d[:, None] + cols[None, :] * sk_s, kt_mask, MASKED or not EVEN_D)
        vt = _load(v_base + offs_d[:, None] + cols[None, :] * sv_s, kt_mask, MASKED or not EVEN_D)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION)
        p = tl.exp2(s * scale_log2 - lse_log2[:, None])
        if MASKED and CAUSAL:
            p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    return dq


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
    EVEN_D: tl.constexpr,
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
    lse_log2 = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=row_ok, other=0.0)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # The same stages as the forward's: whole visible key blocks unmasked, the diagonal and tail masked.
    full = (SK // BLOCK_N) * BLOCK_N
    hi = SK
    if CAUSAL:
        full = tl.minimum(full, (start_m * BLOCK_M // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    dq = _dq_blocks(
        dq, q, do, lse_log2, delta, k_base, v_base, rows, offs_n, offs_d, d_ok, 0, full, SK, sk_s, sv_s,
        scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse_log2, delta, k_base, v_base, rows, offs_n, offs_d, d_ok, full, hi, SK, sk_s, sv_s,
        scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = dq * scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


def _configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in pairs]


# The first config of each list is the one the interpreter runs (small blocks keep tests quick and still
# exercise several blocks, both stage kinds and ragged tails); CUDA autotunes over all of them. The dK/dV
# kernel keeps many keys per program and walks few queries at a time, the dQ kernel the reverse.
FWD_CONFIGS = _configs(
    [(32, 16, 4, 1), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3)]
)
DKDV_CONFIGS = _configs(
    [(16, 32, 4, 1), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3)]
)
DQ_CONFIGS = _configs([(32, 16, 4, 1), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)])
_KEY = ["SQ", "SK", "D", "CAUSAL"]
_FWD = tuned(_attn_fwd_kernel, FWD_CONFIGS, key=_KEY)
_DKDV = tuned(_attn_bwd_dkdv_kernel, DKDV_CONFIGS, key=_KEY)
_DQ = tuned(_attn_bwd_dq_kernel, DQ_CONFIGS, key=_KEY)


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
            EVEN_D=dim == block_d,
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
        block_d = max(16, triton.next_power_of_2(dim))
        delta = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
        delta_rows = 16 if interpreting() else 64
        _attn_bwd_delta_kernel[(triton.cdiv(sq, delta_rows), bsz * hq)](
            o, do, delta, hq, sq, dim, *o.stride()[:3], *do.stride()[:3], BLOCK_M=delta_rows, BLOCK_D=block_d
        )
        dq = torch.empty_like(q)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        common = dict(
            CAUSAL=ctx.causal,
            EVEN_D=dim == block_d,
            UPCAST=interpreting(),
            PRECISION=_precision(q.dtype),
            BLOCK_D=block_d,
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
