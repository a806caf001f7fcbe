"""Linear + cross-entropy in two chunked passes, so the (tokens, vocab) logits never exist at once.

Pass 1, over token chunks (Tc tokens): logits = hidden_chunk @ weight.T (weight dtype); the chunk step
writes each row's loss and log-sum-exp (fp32, one float per token) and, when grad_hidden is wanted,
overwrites the logits with d(mean loss)/d(logits), from which grad_hidden of the chunk is one matmul
written straight into its slice.
Pass 2, over vocab chunks (Vc rows of the weight), only when grad_weight is wanted: s = hidden @ W[vc].T
(tokens x Vc), overwritten in place by the gradient step with (exp(s - lse) - onehot) * valid / count
from the saved log-sum-exps, then grad_weight[vc] = s.T @ hidden written straight into its slice.

Why two passes: chunking over tokens alone makes every chunk add its share into the whole
(vocab, hidden) weight gradient, which then needs an accumulator (fp32, or a lossy low-precision sum)
and re-reads and re-writes it once per chunk, 2 * vocab * hidden elements of memory traffic per chunk.
Chunking the weight gradient over vocab instead writes each of its rows exactly once, in the weight's
dtype, with no accumulator and no accumulation traffic; the price is a fourth GEMM (the logits are
computed again in pass 2: 4 GEMMs of 2 * tokens * hidden * vocab FLOPs instead of 3). Peak extra
memory is grad_weight + grad_hidden + one chunk of logits (grad_weight is allocated after pass 1).

The gradients are computed in the forward (the loss is a scalar) and scaled in place by the incoming
gradient in the backward, which therefore runs once (no retain_graph re-use).
This module has no Triton import: its PyTorch steps are the CPU path of fused_linear_cross_entropy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.autograd_inputs import apply_distinct

# step(logits_chunk, target_chunk, ignore_index, inv_count, loss_out, lse_out, write_grad): writes each
# row's loss (0 for ignored rows) into loss_out and its log-sum-exp into lse_out (fp32); with write_grad
# overwrites logits_chunk with d(mean loss)/d(logits). inv_count is a 0-dim fp32 tensor (1 / valid rows).
ChunkStep = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, bool], None]
# grad_step(scores, target, lse, vocab_start, ignore_index, inv_count): scores (tokens, Vc) hold the
# logits of vocab ids [vocab_start, vocab_start + Vc); overwrites them with d(mean loss)/d(logits).
GradStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.Tensor], None]


def _row_scale(target: torch.Tensor, ignore_index: int, inv_count: torch.Tensor) -> torch.Tensor:
    # valid * (1 / count): 0 for ignored rows (NaN for all rows when nothing is valid, as 0 * inf).
    return (target != ignore_index).to(torch.float32) * inv_count


def _chunk_loss_and_grad_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    inv_count: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    write_grad: bool,
) -> None:
    """The PyTorch pass-1 step (the CPU path): same contract as the Triton one, fp32 math."""
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    x = logits.float()  # logits itself when fp32
    lse = torch.logsumexp(x, dim=-1)
    tgt_logit = x.gather(1, safe_target[:, None])[:, 0]
    loss_out.copy_(torch.where(valid, lse - tgt_logit, 0.0))
    lse_out.copy_(lse)
    if write_grad:
        _write_grad_torch(x, logits, safe_target, valid, lse, _row_scale(target, ignore_index, inv_count))


def _write_grad_torch(x, out, local_target, hit, lse, scale) -> None:
    """out = (exp(x - lse) - onehot(local_target where hit)) * scale per row, computed in place in x
    (x is `out` itself when fp32, else an fp32 copy of it that is written back)."""
    g = x.sub_(lse[:, None]).exp_()
    rows = torch.nonzero(hit)[:, 0]
    g[rows, local_target[rows]] -= 1.0
    g.mul_(scale[:, None])
    if g is not out:
        out.copy_(g)


def _vocab_chunk_grad_torch(
    scores: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
    inv_count: torch.Tensor,
) -> None:
    """The PyTorch pass-2 step (the CPU path): same contract as the Triton one, fp32 math."""
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < scores.shape[1])
    _write_grad_torch(scores.float(), scores, local, hit, lse, _row_scale(target, ignore_index, inv_count))


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def default_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Pass-1 tokens per chunk: a power of two whose logits are no larger than the hidden states (>= 16)."""
    return max(1, min(tokens, _pow2_floor(max(16, tokens * hidden // max(vocab, 1)))))


def default_chunk_vocab(tokens: int, vocab: int, chunk_tokens: int) -> int:
    """Pass-2 vocab rows per chunk: a power of two (>= 16) whose scores (tokens x Vc) are no larger than
    one pass-1 chunk (chunk_tokens x vocab), so pass 2 adds no memory beyond pass 1's chunk."""
    return max(1, min(vocab, _pow2_floor(max(16, chunk_tokens * vocab // max(tokens, 1)))))


class _FusedLinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, target, ignore_index, chunk_tokens, chunk_vocab, step, grad_step, with_grad
    ):
        hid = hidden.reshape(-1, hidden.shape[-1])
        tgt = target.reshape(-1).long()
        tokens, vocab = hid.shape[0], weight.shape[0]
        count = (tgt != ignore_index).sum().to(torch.float32)
        inv_count = 1.0 / count
        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        row_loss = torch.empty(tokens, dtype=torch.float32, device=hid.device)
        lse = torch.empty_like(row_loss)
        grad_h = torch.empty_like(hid) if need_h else None
        # Pass 1 (token chunks): loss, log-sum-exp, grad_hidden.
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            logits = hid[start:end] @ weight.t()
            step(logits, tgt[start:end], ignore_index, inv_count, row_loss[start:end], lse[start:end], need_h)
            if need_h:  # `logits` now holds d(loss)/d(logits) of the chunk
                torch.mm(logits, weight, out=grad_h[start:end])
            del logits
        # Pass 2 (vocab chunks): every row of grad_weight written once, in the weight's dtype.
        grad_w = None
        if need_w:
            grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            for v0 in range(0, vocab, chunk_vocab):
                v1 = min(v0 + chunk_vocab, vocab)
                scores = hid @ weight[v0:v1].t()
                grad_step(scores, tgt, lse, v0, ignore_index, inv_count)
                torch.mm(scores.t(), hid, out=grad_w[v0:v1])
                del scores
        # Held as attributes, not saved tensors, so that backward can drop ctx's reference and hand
        # autograd the only one: it then keeps the tensor as .grad instead of cloning it.
        ctx.grads = (grad_h, grad_w)
        ctx.hidden_shape = hidden.shape
        return row_loss.sum() * inv_count

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy's backward can run only once (no retain_graph)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # Scale in place: the gradients are used once, and a copy would double grad_weight.
        dh = grad_h.mul_(grad_loss.to(grad_h.dtype)).view(ctx.hidden_shape) if grad_h is not None else None
        dw = grad_w.mul_(grad_loss.to(grad_w.dtype)) if grad_w is not None else None
        del grad_h, grad_w
        return dh, dw, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    step: ChunkStep | None = None,
    grad_step: GradStep | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against target; the logits exist one chunk at a time.

    `chunk_tokens`: tokens per pass-1 chunk; `chunk_vocab`: weight rows per pass-2 chunk (module doc).
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, hidden={hidden.shape[-1]}); got {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    for name, t in (("weight", weight), ("target", target)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; move them together")
    tokens, vocab = target.numel(), weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(tokens, hidden.shape[-1], vocab)
    if chunk_vocab is None:
        chunk_vocab = default_chunk_vocab(tokens, vocab, chunk_tokens)
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk_tokens and chunk_vocab must be >= 1; got {chunk_tokens}, {chunk_vocab}")
    # Gradients are computed during the forward, so skip them when no backward can follow (eval).
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return apply_distinct(
        _FusedLinearCrossEntropyFn,
        hidden,
        weight,
        target,
        int(ignore_index),
        int(chunk_tokens),
        int(chunk_vocab),
        step or _chunk_loss_and_grad_torch,
        grad_step or _vocab_chunk_grad_torch,
        with_grad,
    )
