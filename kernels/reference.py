"""Plain PyTorch implementations of every kernel: the fallback path and the tests' reference."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.autograd_inputs import apply_distinct


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with statistics in fp32, as Hugging Face LLaMA/ERNIE compute it."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The 90-degree rotation of each (x_i, x_j) pair: halves (NeoX) or adjacent pairs (GPT-J)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotary embedding of x (batch, seq, heads, head_dim) with cos/sin (seq, head_dim), computed in fp32."""
    cos = cos[:, None, :].float()
    sin = sin[:, None, :].float()
    xf = x.float()
    return (xf * cos + rotate_half(xf, interleaved) * sin).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up."""
    return F.gelu(gate, approximate="tanh") * up


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads (grouped-query)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    q_offset: int,
    k_offset: int,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """q (b, hk, g, n, d), k (b, hk, m, d) -> scaled scores (b, hk, g, n, m), -inf where key j is causally
    hidden from query i (k_offset + j > q_offset + i) or `allowed` (b, n, m), if given, is false."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        rows = torch.arange(n, device=s.device)[:, None] + q_offset
        hidden = torch.arange(m, device=s.device)[None, :] + k_offset > rows
        s = s.masked_fill(hidden, -math.inf)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None, None], -math.inf)
    return s


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, n, d) -> (b, kv_heads, h / kv_heads, n, d): the query heads of each kv head together."""
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention (kernels/attention.py's attention_block): q (b, hq, n, d) at global positions
    q_offset.., k/v (b, hk, m, d) at k_offset.., restricted to `allowed` (b, n, m) pairs if given -> output
    (b, hq, n, d) and log-sum-exp (b, hq, n) in at least fp32. A row that sees no key has output 0 and
    log-sum-exp -inf, which a merge by log-sum-exps ignores."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    hk = k.shape[1]
    s = _block_scores(_grouped(q.to(dtype), hk), k.to(dtype), scale, causal, q_offset, k_offset, allowed)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    out = torch.matmul(p, v.to(dtype).unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


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
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (at least fp32) of one block of attention_block's, its probabilities recomputed from
    `lse` (b, hq, n), the log-sum-exp of the rows' final (merged) output `out` (b, hq, n, d), whose
    rowsum(dO * O) is the softmax's backward term."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    hk = k.shape[1]
    qg, dog = _grouped(q.to(dtype), hk), _grouped(do.to(dtype), hk)
    delta = (do.to(dtype) * out.to(dtype)).sum(-1)
    k, v = k.to(dtype), v.to(dtype)
    s = _block_scores(qg, k, scale, causal, q_offset, k_offset, allowed)
    p = torch.exp(s - _grouped(lse.to(dtype)[..., None], hk))
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - _grouped(delta.to(dtype)[..., None], hk))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq.flatten(1, 2), dk, dv


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy over the non-ignored targets, in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=ignore_index
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target), materialising the logits."""
    return cross_entropy(hidden @ weight.t(), target, ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits: max and sum-exp combined with all_reduce over the group."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, group):
        vocab_local = logits.shape[-1]
        vocab_start = dist.get_rank(group) * vocab_local
        x = logits.float()
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        local = target - vocab_start
        in_slice = (local >= 0) & (local < vocab_local)
        local = torch.where(in_slice, local, 0)
        picked = x.gather(1, local[:, None])[:, 0]
        packed = torch.stack(((x - row_max[:, None]).exp().sum(-1), torch.where(in_slice, picked, 0.0)))
        dist.all_reduce(packed, group=group)
        lse = row_max + packed[0].log()
        valid = target != ignore_index
        count = valid.sum().to(torch.float32)
        ctx.save_for_backward(logits, local, in_slice, lse, valid, count)
        return torch.where(valid, lse - packed[1], 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, in_slice, lse, valid, count = ctx.saved_tensors
        grad = (logits.float() - lse[:, None]).exp()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= in_slice.to(grad.dtype)
        grad *= (valid.to(torch.float32) * (grad_loss / count))[:, None]
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Mean cross-entropy where each rank of `group` holds vocab ids [rank*V, (rank+1)*V) of the logits."""
    return apply_distinct(
        _VocabParallelCrossEntropy,
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index,
        group,
    )


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) split into groups at the cumulative row `offsets` (E,), group e times weight[e]^T
    (weight (E, N, K)): one F.linear per group."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    parts = [F.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts))]
    return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])
