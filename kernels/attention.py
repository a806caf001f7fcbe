"""Flash attention in Triton (forward and backward): causal or full, grouped-query, fp32 accumulation.

q is (batch, q_heads, seq_q, head_dim); k and v are (batch, kv_heads, seq_k, head_dim) with q_heads a
multiple of kv_heads. Query head h reads kv head h // (q_heads // kv_heads) through pointer arithmetic,
so k/v are never repeated. The causal mask is top-left aligned (key j is visible to query i when j <= i),
the convention of torch's scaled_dot_product_attention(is_causal=True). Blocks of a longer sequence
(ring attention) give their global offsets: key j is then visible to query i when k_offset + j <=
q_offset + i, i.e. j <= i + SHIFT with SHIFT = q_offset - k_offset; a row that sees no key gets output 0
and log-sum-exp -inf, so that merging blocks by their log-sum-exps ignores it.

Forward: online softmax over key blocks in base 2; saves the output and the per-row log-sum-exp (natural
log, fp32). Backward: delta = rowsum(dO * O) by a small kernel; one kernel per key block accumulates dK and
dV over every query head of its group (no atomics), a second kernel per query block accumulates dQ.

Every loop over blocks runs in stages: the blocks no mask can touch (fully visible to the causal mask,
inside both sequence lengths) load and multiply without any masking, and only the few blocks on the
diagonal or at a ragged tail pay for masks. The backward kernels compute transposed tiles directly
(S^T = K Q^T, dS^T) from transposed loads, so no tile computed in registers is ever transposed before a
matrix product: the GEMM operands all come from memory.
Under the interpreter every loaded tile is cast to fp32 first: fp16/bf16 arithmetic there is unreliable.

attention_block / attention_block_grads expose one block's forward (output and log-sum-exp, fp32) and its
backward from given (final) log-sum-exp and delta rows, the two steps ring attention runs per block.

One module over the house's 700 lines because it is one unit: the three kernels share the staged block
loops and masking helpers above them, and their launches share the configs the autotuner picks from.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._utils import check_same_device, compiled_as_op, interpreting, launch_layout, tuned
from kernels.autograd_inputs import apply_distinct
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
def _visible_keys(start_m, SK, SHIFT, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full, hi) of query block `start_m`: key blocks [0, full) are visible to all its rows and inside SK
    (no mask), [full, hi) need the masks, keys from hi on are invisible to every row. Causal: key j is
    visible to row i when j <= i + SHIFT, so the block's first row sees keys < start_m * BLOCK_M + SHIFT
    + 1 and its last row keys < (start_m + 1) * BLOCK_M + SHIFT (bounds clamped at 0 before dividing)."""
    full = (SK // BLOCK_N) * BLOCK_N
    hi = SK
    if CAUSAL:
        full = tl.minimum(full, (tl.maximum(start_m * BLOCK_M + SHIFT, 0) // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(SK, tl.maximum((start_m + 1) * BLOCK_M + SHIFT, 0))
    return full, hi


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
    SHIFT,
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
                valid = valid & (cols[None, :] <= rows[:, None] + SHIFT)
            s = tl.where(valid, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet (offset blocks) keeps max -inf: subtract 0 instead of -inf
            # so its p and alpha are 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
        else:
            # Scale the row max, not the tile, then one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_use = m_new
            p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_use)
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
    SHIFT,
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
    full, hi = _visible_keys(start_m, SK, SHIFT, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, rows, offs_n, offs_d, d_ok, 0, full, SK, SHIFT, sk_s, sv_s,
        scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, rows, offs_n, offs_d, d_ok, full, hi, SK, SHIFT, sk_s, sv_s,
        scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    # Rows that saw no key (l = 0): output 0, log-sum-exp -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
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
    SHIFT,
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
            pt = tl.where(cols[:, None] <= rows[None, :] + SHIFT, pt, 0.0)
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
    SHIFT,
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
        # Query i sees key j when j <= i + SHIFT: queries before the block's first key - SHIFT cannot see
        # it; from the first query block starting at or after its last key - SHIFT, every query sees every
        # key (bounds clamped at 0 before dividing).
        lo = (tl.maximum(start_n * BLOCK_N - SHIFT, 0) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(
            tl.cdiv(tl.maximum((start_n + 1) * BLOCK_N - SHIFT, 0), BLOCK_M) * BLOCK_M,
            tl.cdiv(SQ, BLOCK_M) * BLOCK_M,
        )
    full = tl.maximum((SQ // BLOCK_M) * BLOCK_M, mid)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sdo_b + h * sdo_h
        lse_base = LSE + (b * HQ + h) * SQ
        delta_base = DELTA + (b * HQ + h) * SQ
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, lo, mid, SQ,
            SHIFT, sq_s, sdo_s, scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, mid, full, SQ,
            SHIFT, sq_s, sdo_s, scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_m, offs_d, d_ok, full, SQ, SQ,
            SHIFT, sq_s, sdo_s, scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_M,
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
    SHIFT,
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
            p = tl.where(cols[None, :] <= rows[:, None] + SHIFT, p, 0.0)
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
    SHIFT,
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
    full, hi = _visible_keys(start_m, SK, SHIFT, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_blocks(
        dq, q, do, lse_log2, delta, k_base, v_base, rows, offs_n, offs_d, d_ok, 0, full, SK, SHIFT, sk_s,
        sv_s, scale_log2, False, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse_log2, delta, k_base, v_base, rows, offs_n, offs_d, d_ok, full, hi, SK, SHIFT, sk_s,
        sv_s, scale_log2, True, CAUSAL, EVEN_D, UPCAST, PRECISION, BLOCK_N,
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


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (no TF32) so they match an fp32 reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward_shapes(q, k, v, causal, scale, shift, out_dtype):
    bsz, hq, sq, dim = q.shape
    return q.new_empty((bsz, hq, sq, dim), dtype=out_dtype), q.new_empty((bsz, hq, sq), dtype=torch.float32)


@compiled_as_op("attention_forward", _forward_shapes)
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: output (b, hq, sq, d) in `out_dtype` and log-sum-exp (b, hq, sq) fp32."""
    q, k, v = (launch_layout(t) for t in (q, k, v))
    bsz, hq, sq, dim = q.shape
    hk, sk = k.shape[1], k.shape[2]
    o = torch.empty((bsz, hq, sq, dim), dtype=out_dtype, device=q.device)
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
        shift,
        dim,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        CAUSAL=causal,
        EVEN_D=dim == block_d,
        UPCAST=interpreting(),
        PRECISION=_precision(q.dtype),
        BLOCK_D=block_d,
    )
    return o, lse


@compiled_as_op("attention_delta", lambda o, do: o.new_empty(o.shape[:3], dtype=torch.float32))
def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) (b, h, s) in fp32 by the delta kernel."""
    o, do = launch_layout(o), launch_layout(do)
    bsz, hq, sq, dim = o.shape
    delta = torch.empty((bsz, hq, sq), dtype=torch.float32, device=o.device)
    rows = 16 if interpreting() else 64
    _attn_bwd_delta_kernel[(triton.cdiv(sq, rows), bsz * hq)](
        o, do, delta, hq, sq, dim, *o.stride()[:3], *do.stride()[:3], BLOCK_M=rows,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return delta


def _backward_shapes(do, q, k, v, lse, delta, causal, scale, shift, grad_dtype):
    return tuple(t.new_empty(t.shape, dtype=grad_dtype or t.dtype) for t in (q, k, v))


@compiled_as_op("attention_backward", _backward_shapes)
def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    grad_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dK/dV and dQ kernels from the rows' log-sum-exp and delta (contiguous (b, hq, sq) fp32);
    gradients in `grad_dtype` (None: each input's own)."""
    do, q, k, v = (launch_layout(t) for t in (do, q, k, v))
    lse, delta = lse.contiguous(), delta.contiguous()
    bsz, hq, sq, dim = q.shape
    hk, sk = k.shape[1], k.shape[2]
    block_d = max(16, triton.next_power_of_2(dim))
    dq = torch.empty(q.shape, dtype=grad_dtype or q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=grad_dtype or k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=grad_dtype or v.dtype, device=v.device)
    common = dict(
        CAUSAL=causal,
        EVEN_D=dim == block_d,
        UPCAST=interpreting(),
        PRECISION=_precision(q.dtype),
        BLOCK_D=block_d,
    )
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    _DKDV(q.device)[lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), bsz * hk)](
        q, k, v, do, lse, delta, dk, dv, scale, scale * LOG2E, hq, hk, hq // hk, sq, sk, shift, dim,
        *strides, *dk.stride()[:3], *dv.stride()[:3], **common,
    )  # fmt: skip
    _DQ(q.device)[lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), bsz * hq)](
        q, k, v, do, lse, delta, dq, scale, scale * LOG2E, hq, hq // hk, sq, sk, shift, dim,
        *strides, *dq.stride()[:3], **common,
    )  # fmt: skip
    return dq, dk, dv


class _FlashAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _forward(q, k, v, causal, scale, 0, q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, lse, _delta(o, do), ctx.causal, ctx.scale, 0, None)
        return dq, dk, dv, None, None


def _checked_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> float:
    """Validate the arguments for the Triton kernels; the softmax scale (default 1/sqrt(head_dim))."""
    check_attention_args(q, k, v)
    check_same_device(q=q, k=k, v=v)
    if q.shape[3] > 256:
        raise ValueError(
            f"triton flash_attention supports head_dim <= 256; got {q.shape[3]}, use impl='torch'"
        )
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """Triton flash attention over (batch, heads, seq, head_dim); k/v may have fewer heads."""
    scale = _checked_scale(q, k, v, softmax_scale)
    return apply_distinct(_FlashAttentionFn, q, k, v, bool(causal), scale)


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention without autograd: q (b, hq, n, d) at global positions q_offset.., k/v
    (b, hk, m, d) at k_offset.. -> output (b, hq, n, d) and log-sum-exp (b, hq, n), both fp32 so blocks
    merge without rounding. Causal: key j visible to query i when k_offset + j <= q_offset + i."""
    scale = _checked_scale(q, k, v, softmax_scale)
    return _forward(q, k, v, bool(causal), scale, q_offset - k_offset, torch.float32)


def attention_block_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (fp32) of one block of attention_block's, its probabilities recomputed from `lse` (b, hq,
    n), the log-sum-exp of the rows' final (merged) output `out` (b, hq, n, d), with delta = rowsum(dO * O)
    of that final output: a block's share of the gradient of the whole attention."""
    scale = _checked_scale(q, k, v, softmax_scale)
    delta = _delta(out, do)
    return _backward(do, q, k, v, lse.float(), delta, bool(causal), scale, q_offset - k_offset, torch.float32)
