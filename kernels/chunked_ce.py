"""Linear + cross-entropy over token chunks, so the (tokens, vocab) logits never exist at once.

Per chunk: logits = hidden_chunk @ weight.T, the chunk's loss and d(mean loss)/d(logits) written over the
logits buffer (by the Triton kernels or by the PyTorch step below), then grad_hidden of the chunk and the
weight gradient accumulated in fp32. The gradients are computed in the forward (the loss is a scalar) and
scaled by the incoming gradient in the backward, which therefore runs once (no retain_graph re-use).
This module has no Triton import: its PyTorch step is the CPU path of fused_linear_cross_entropy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# step(logits_chunk, target_chunk, ignore_index, 1/num_valid) -> per-row losses; overwrites logits_chunk
# with d(mean loss)/d(logits).
ChunkStep = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def _chunk_loss_and_grad_torch(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, inv_count: torch.Tensor
):
    """The PyTorch chunk step (the CPU path): same contract as the Triton one, fp32 math."""
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
    return max(1, min(tokens, 1 << (target - 1).bit_length()))


class _FusedLinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, chunk_tokens, step, with_grad):
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
    step: ChunkStep | None = None,
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
    for name, t in (("weight", weight), ("target", target)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; move them together")
    tokens = target.numel()
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(tokens, hidden.shape[-1], weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    # Gradients are computed during the forward, so skip them when no backward can follow (eval).
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropyFn.apply(
        hidden,
        weight,
        target,
        int(ignore_index),
        int(chunk_tokens),
        step or _chunk_loss_and_grad_torch,
        with_grad,
    )
