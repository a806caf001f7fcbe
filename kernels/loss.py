"""Cross-entropy in Triton without materialising probabilities; vocab-parallel and fused linear variants.

Forward kernel, one program per row: a single pass over the vocabulary in blocks keeps a running max and
sum of exponentials per lane (online softmax) and picks up the target logit when the target falls in
this rank's vocab slice. Per-row (max, sumexp, target logit) are all that leave the kernel; with a TP
group they are combined with two all_reduces (max, then rescaled sumexp and target logit together).
Backward kernel: d loss / d logit = (exp(logit - lse) - onehot) * scale_row, written per block; it may
write in place over the logits (the fused linear variant's chunk buffer).

fused_linear_cross_entropy walks the tokens in chunks: logits of one chunk, their loss and gradient (in
place), then grad_hidden of the chunk and grad_weight accumulated in fp32, so the (tokens, vocab) logits
never exist. Gradients are computed in the forward (the loss is a scalar) and scaled in the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels._utils import check_same_device


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
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
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
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(dbase + cols, g.to(DLOGITS.dtype.element_ty), mask=ok)


def _block_v(v: int) -> int:
    return min(4096, triton.next_power_of_2(v))


def _row_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> tuple[torch.Tensor, ...]:
    """Per-row (max, sum of exp(logit - max), target logit or 0 when outside this vocab slice), fp32."""
    rows, vocab = logits.shape
    mx = torch.empty(rows, dtype=torch.float32, device=logits.device)
    se = torch.empty_like(mx)
    tg = torch.empty_like(mx)
    if rows:
        _ce_fwd_kernel[(rows,)](
            logits,
            target,
            mx,
            se,
            tg,
            vocab,
            logits.stride(0),
            vocab_start,
            BLOCK_V=_block_v(vocab),
            num_warps=8 if vocab >= 8192 else 4,
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
    if rows:
        _ce_bwd_kernel[(rows,)](
            logits,
            out,
            target,
            lse,
            scale,
            vocab,
            logits.stride(0),
            out.stride(0),
            vocab_start,
            BLOCK_V=_block_v(vocab),
            num_warps=8 if vocab >= 8192 else 4,
        )


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
        grad = torch.empty_like(logits)
        _logit_grad(logits, grad, target, lse, scale, ctx.vocab_start)
        return grad, None, None, None


def check_ce_args(logits: torch.Tensor, target: torch.Tensor) -> None:
    """Validate shapes for cross_entropy (shared by both implementations)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits' leading dims {tuple(logits.shape[:-1])}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold integer class ids (int64); got {target.dtype}")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Triton mean cross-entropy; with tp_group, logits is this rank's vocab shard, target global ids."""
    check_ce_args(logits, target)
    check_same_device(logits=logits, target=target)
    logits2 = logits.reshape(-1, logits.shape[-1])
    if logits2.stride(-1) != 1:
        logits2 = logits2.contiguous()
    return _CrossEntropyFn.apply(logits2, target.reshape(-1).contiguous().long(), int(ignore_index), tp_group)


def _chunk_loss_and_grad_triton(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, inv_count: torch.Tensor
):
    """Row losses of one chunk; overwrites `logits` with d(mean loss)/d(logits)."""
    mx, se, tg = _row_stats(logits, target, 0)
    lse = mx + torch.log(se)
    valid = target != ignore_index
    _logit_grad(logits, logits, target, lse, valid.to(torch.float32) * inv_count, 0)
    return torch.where(valid, lse - tg, 0.0)


def _chunk_loss_and_grad_torch(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, inv_count: torch.Tensor
):
    """PyTorch twin of the Triton chunk step (the CPU path): same contract, fp32 math."""
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = -logp.gather(1, safe_target[:, None])[:, 0]
    grad = logp.exp_()
    grad[torch.arange(grad.shape[0], device=grad.device), safe_target] -= 1.0
    grad.mul_((valid.to(torch.float32) * inv_count)[:, None])
    logits.copy_(grad)
    return torch.where(valid, rows, 0.0)


def default_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk so that one chunk's logits are about as large as the hidden states (at least 16)."""
    target = max(16, tokens * hidden // max(vocab, 1))
    return max(1, min(tokens, triton.next_power_of_2(target)))


class _FusedLinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, chunk_tokens, use_triton, with_grad):
        hid = hidden.reshape(-1, hidden.shape[-1])
        tgt = target.reshape(-1).long()
        tokens = hid.shape[0]
        valid = tgt != ignore_index
        count = valid.sum().to(torch.float32)
        inv_count = 1.0 / count
        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hid) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # Low-precision weights: each chunk's weight-grad product lands in one reused scratch buffer, then
        # joins the fp32 accumulator (a fresh product per chunk would allocate vocab x hidden every time).
        scratch = torch.empty_like(weight) if need_w and weight.dtype != torch.float32 else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_loss_and_grad_triton if use_triton else _chunk_loss_and_grad_torch
        for start in range(0, tokens, chunk_tokens):
            h_chunk = hid[start : start + chunk_tokens]
            logits = h_chunk @ weight.t()
            loss += step(logits, tgt[start : start + chunk_tokens], ignore_index, inv_count).sum()
            # `logits` now holds d(loss)/d(logits) for the chunk.
            if need_h:
                torch.mm(logits, weight, out=grad_h[start : start + chunk_tokens])
            if need_w and scratch is None:
                grad_w.addmm_(logits.t(), h_chunk)
            elif need_w:
                torch.mm(logits.t(), h_chunk, out=scratch)
                grad_w += scratch
            del logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        return loss * inv_count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        dh = dw = None
        # Scale in place: the saved gradients are used once, and a copy would double the fp32 weight grad.
        if grad_h is not None:
            dh = grad_h.mul_(grad_loss.to(grad_h.dtype)).view(ctx.hidden_shape)
        if grad_w is not None:
            dw = grad_w.mul_(grad_loss.float()).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    use_triton: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against target, chunked over tokens (logits never whole)."""
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, hidden={hidden.shape[-1]}); got {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    check_same_device(hidden=hidden, weight=weight, target=target)
    tokens = target.numel()
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(tokens, hidden.shape[-1], weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    # Gradients are computed during the forward, so skip them when no backward can follow (eval).
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropyFn.apply(
        hidden, weight, target, int(ignore_index), int(chunk_tokens), use_triton, with_grad
    )
