"""Cross-entropy in Triton without materialising probabilities; vocab-parallel and fused linear variants.

Forward kernel, one program per row: a single pass over the vocabulary in blocks keeps a running max and
sum of exponentials per lane (online softmax) and picks up the target logit when the target falls in
this rank's vocab slice. Per-row (max, sumexp, target logit) are all that leave the kernel; with a TP
group they are combined with two all_reduces (max, then rescaled sumexp and target logit together).
Backward kernel: d loss / d logit = (exp(logit - lse) - onehot) * scale_row, written per block; it may
write in place over the logits (the fused linear variant's chunk buffer).
The fused linear variant (kernels/chunked_ce.py) has two kernels of its own: pass 1 (one token chunk of
logits) writes each row's loss and log-sum-exp and, when grad_hidden is needed, the logit gradient in
place; pass 2 (one vocab chunk of logits, recomputed) writes the logit gradient in place from those
log-sum-exps, for the weight gradient of that vocab slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels import chunked_ce
from kernels._utils import check_same_device, compiled_as_op, launch_layout, tuned
from kernels.autograd_inputs import apply_distinct
from kernels.checks import check_ce_args


@triton.jit
def _row_max_and_sum(base, V, BLOCK_V: tl.constexpr):
    """Online softmax statistics of one row of V logits at `base`: its max and sum(exp(x - max)), fp32."""
    m = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have only seen -inf keep a 0 reference so exp() never sees (-inf) - (-inf).
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    row_max = tl.max(m, axis=0)
    return row_max, tl.sum(s * tl.exp(m - row_max), axis=0)


@triton.jit
def _write_row_grad(src, dst, V, lse, local, scale, BLOCK_V: tl.constexpr):
    """d(loss)/d(logits) of one row: (softmax - onehot(local)) * scale, read from `src`, written to `dst`
    (the same row when the gradient overwrites the logits)."""
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < V
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(dst + cols, g.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _ce_fwd_kernel(
    LOGITS,
    TARGET,
    MAX_OUT,
    SUM_OUT,
    TGT_OUT,
    V,
    stride_row,
    vocab_start,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    row_max, row_sum = _row_max_and_sum(base, V, BLOCK_V)
    local = tl.load(TARGET + row) - vocab_start
    in_slice = (local >= 0) & (local < V)
    tgt = tl.load(base + local, mask=in_slice, other=0.0).to(tl.float32)
    tl.store(MAX_OUT + row, row_max)
    tl.store(SUM_OUT + row, row_sum)
    tl.store(TGT_OUT + row, tgt)


@triton.jit
def _ce_bwd_kernel(
    LOGITS,
    DLOGITS,
    TARGET,
    LSE,
    SCALE,
    V,
    stride_row,
    stride_drow,
    vocab_start,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    dbase = DLOGITS + row * stride_drow
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    local = tl.load(TARGET + row) - vocab_start
    _write_row_grad(base, dbase, V, lse, local, scale, BLOCK_V)


def _block_v(v: int) -> int:
    return min(4096, triton.next_power_of_2(v))


def _warps(v: int) -> int:
    return 8 if v >= 8192 else 4


def _tuned_warps(kernel: triton.JITFunction) -> dict[int, Callable]:
    # CUDA autotunes the warps per vocab size, the untuned heuristic first (the one the interpreter runs).
    return {
        w: tuned(
            kernel, [triton.Config({}, num_warps=x) for x in dict.fromkeys([w, 4, 8, 16])], ["V", "BLOCK_V"]
        )
        for w in (4, 8)
    }


# Only launches that overwrite all their outputs are autotuned (autotuning reruns them): the statistics
# kernel, and the gradient kernel when it does not write over its own logits (the fused linear variant).
_FWD = _tuned_warps(_ce_fwd_kernel)
_BWD = _tuned_warps(_ce_bwd_kernel)


def _stats_shapes(logits, target, vocab_start):
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


@compiled_as_op("cross_entropy_row_stats", _stats_shapes)
def _row_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (max, sum of exp(logit - max), target logit or 0 when outside this vocab slice), fp32."""
    logits = launch_layout(logits)
    rows, vocab = logits.shape
    mx = torch.empty(rows, dtype=torch.float32, device=logits.device)
    se = torch.empty_like(mx)
    tg = torch.empty_like(mx)
    if rows:
        _FWD[_warps(vocab)](logits.device)[(rows,)](
            logits,
            target,
            mx,
            se,
            tg,
            vocab,
            logits.stride(0),
            vocab_start,
            BLOCK_V=_block_v(vocab),
        )
    return mx, se, tg


def _logit_grad(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int,
) -> None:
    rows, vocab = logits.shape
    if not rows:
        return
    args = (logits, out, target, lse, scale, vocab, logits.stride(0), out.stride(0), vocab_start)
    if out is logits:  # in place (fused linear CE): a rerun would read gradients, so never autotuned
        _ce_bwd_kernel[(rows,)](*args, BLOCK_V=_block_v(vocab), num_warps=_warps(vocab))
    else:
        _BWD[_warps(vocab)](logits.device)[(rows,)](*args, BLOCK_V=_block_v(vocab))


@compiled_as_op(
    "cross_entropy_logit_grad",
    lambda logits, target, lse, scale, vocab_start: logits.new_empty(logits.shape),
)
def _logit_grad_of(
    logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """d(loss)/d(logits) into a new tensor."""
    logits = launch_layout(logits)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _logit_grad(logits, grad, target, lse, scale, vocab_start)
    return grad


def _combine(
    mx: torch.Tensor, se: torch.Tensor, tg: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global log-sum-exp and target logit per row from the local statistics (all_reduce over `group`)."""
    if group is not None:
        gmax = mx.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        packed = torch.stack((se * torch.exp(mx - gmax), tg))
        dist.all_reduce(packed, group=group)
        mx, se, tg = gmax, packed[0], packed[1]
    return mx + torch.log(se), tg


def vocab_slice_start(vocab_local: int, group: dist.ProcessGroup | None) -> int:
    """First global vocab id held by this rank: shards are equal and ordered by rank in `group`."""
    return 0 if group is None else dist.get_rank(group) * vocab_local


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, group):
        vocab_start = vocab_slice_start(logits.shape[1], group)
        mx, se, tg = _row_stats(logits, target, vocab_start)
        lse, tgt_logit = _combine(mx, se, tg, group)
        valid = target != ignore_index
        count = valid.sum().to(torch.float32)
        loss = torch.where(valid, lse - tgt_logit, 0.0).sum() / count
        ctx.save_for_backward(logits, target, lse, valid, count)
        ctx.vocab_start = vocab_start
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse, valid, count = ctx.saved_tensors
        scale = valid.to(torch.float32) * (grad_loss.to(torch.float32) / count)
        return _logit_grad_of(logits, target, lse, scale, ctx.vocab_start), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Triton mean cross-entropy; with tp_group, logits is this rank's vocab shard, target global ids."""
    check_ce_args(logits, target)
    check_same_device(logits=logits, target=target)
    logits2 = launch_layout(logits.reshape(-1, logits.shape[-1]))
    return apply_distinct(
        _CrossEntropyFn, logits2, target.reshape(-1).contiguous().long(), int(ignore_index), tp_group
    )


@triton.jit
def _flce_rows_kernel(
    LOGITS,
    TARGET,
    INV_COUNT,
    LOSS_OUT,
    LSE_OUT,
    V,
    stride_row,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 of the fused linear variant, one program per row: loss and log-sum-exp of the row, and with
    WRITE_GRAD its d(mean loss)/d(logits) written over the logits (a second sweep of the row)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    row_max, row_sum = _row_max_and_sum(base, V, BLOCK_V)
    lse = row_max + tl.log(row_sum)
    tgt = tl.load(TARGET + row)
    valid = tgt != ignore_index
    in_range = valid & (tgt >= 0) & (tgt < V)
    x_t = tl.load(base + tgt, mask=in_range, other=0.0).to(tl.float32)
    tl.store(LOSS_OUT + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE_OUT + row, lse)
    if WRITE_GRAD:
        # valid * (1 / count): NaN for every row when nothing is valid (0 * inf), as the PyTorch step.
        scale = tl.where(valid, 1.0, 0.0) * tl.load(INV_COUNT)
        _write_row_grad(base, base, V, lse, tgt, scale, BLOCK_V)


@triton.jit
def _flce_vocab_grad_kernel(
    S,
    TARGET,
    LSE,
    INV_COUNT,
    V,
    stride_row,
    vocab_start,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    """Pass 2, program (row, column block): the scores of vocab ids [vocab_start, vocab_start + V) are
    overwritten with (exp(s - lse) - onehot(target)) * valid / count, using pass 1's log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    ptrs = S + row * stride_row + cols
    tgt = tl.load(TARGET + row)
    scale = tl.where(tgt != ignore_index, 1.0, 0.0) * tl.load(INV_COUNT)
    lse = tl.load(LSE + row)
    local = tgt - vocab_start  # an ignored row's target never matches a column (scale is 0 there anyway)
    hit = (cols == local) & (tgt != ignore_index)
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    g = (tl.exp(x - lse) - tl.where(hit, 1.0, 0.0)) * scale
    tl.store(ptrs, g.to(S.dtype.element_ty), mask=ok)


def _chunk_loss_and_grad_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    inv_count: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    write_grad: bool,
) -> None:
    """Pass-1 step (chunked_ce.ChunkStep): row losses and log-sum-exps; with write_grad, `logits` is
    overwritten with d(mean loss)/d(logits)."""
    rows, vocab = logits.shape
    if rows:
        _flce_rows_kernel[(rows,)](
            logits,
            target,
            inv_count,
            loss_out,
            lse_out,
            vocab,
            logits.stride(0),
            ignore_index,
            WRITE_GRAD=write_grad,
            BLOCK_V=_block_v(vocab),
            num_warps=8 if vocab >= 8192 else 4,
        )


def _vocab_chunk_grad_triton(
    scores: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    inv_count: torch.Tensor,
) -> None:
    """Pass-2 step (chunked_ce.GradStep): `scores` overwritten in place with d(mean loss)/d(logits)."""
    rows, vocab = scores.shape
    block = min(1024, triton.next_power_of_2(vocab))
    if rows and vocab:
        _flce_vocab_grad_kernel[(rows, triton.cdiv(vocab, block))](
            scores,
            target,
            lse,
            inv_count,
            vocab,
            scores.stride(0),
            vocab_start,
            ignore_index,
            BLOCK_V=block,
            num_warps=4,
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor:
    """Chunked linear + cross-entropy (kernels/chunked_ce.py) whose two per-chunk steps run in Triton."""
    return chunked_ce.fused_linear_cross_entropy(
        hidden,
        weight,
        target,
        ignore_index,
        chunk_tokens,
        step=_chunk_loss_and_grad_triton,
        grad_step=_vocab_chunk_grad_triton,
        chunk_vocab=chunk_vocab,
    )
