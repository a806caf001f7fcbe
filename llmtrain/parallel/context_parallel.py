"""Context parallelism: each sequence split over the cp ranks, attention across the split, one loss.

The split itself (which chunks a rank holds, its inputs and the loss over the CP group) is
llmtrain.parallel.context_split's; this module makes a CausalLM attend across it (`apply_cp`).

Attention (each block's `attn.core` is replaced, as apply_tp and apply_recompute replace it):

* ``ring``: K/V travel around the CP ring by point-to-point transfers (batch_isend_irecv), each transfer
  overlapped with attention on the K/V block in hand. Each (query chunk, key chunk) pair is fully visible,
  fully masked (skipped) or diagonal (causal); the partial outputs are merged by their log-sum-exp. The
  backward recomputes each block's probabilities from the final log-sum-exp and passes dK/dV around the
  ring with the K/V they belong to, so they arrive home after cp transfers. Each block is
  kernels.flash_attention_block(_grads) at the chunks' global offsets: the Triton kernel with
  model.kernels=triton, PyTorch otherwise and always with packed documents (on CPU tensors torch's fused
  flash-attention kernel, given the final output and log-sum-exp in the backward).
* ``all_to_all`` (Ulysses): an all-to-all scatters the heads and gathers the sequence, each rank runs causal
  attention over the whole sequence for cp-th of the heads, and the reverse all-to-all brings its tokens
  back. Grouped-query K/V with fewer heads than cp ranks are replicated up to a multiple of cp first.

Mixtures of experts. Routing is per token, so an MoE layer routes this rank's tokens unchanged; its router
statistics are summed over the CP group after each forward (as over TP: sum_router_stats), so the router
losses, the load figures and the score-bias update see the whole micro-batch, each rank's gradient staying
with its own tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import kernels
from llmtrain.models.documents import document_attention, same_document
from llmtrain.models.mla import LatentAttention
from llmtrain.models.moe import MoEMLP
from llmtrain.parallel import comm
from llmtrain.parallel.context_split import ContextSplit, chunk_ids, merge_sequence, split_sequence
from llmtrain.parallel.tensor_parallel import share_capacity, sum_router_stats
from llmtrain.parallel.topology import Topology

FULL, DIAGONAL, MASKED = "full", "diagonal", "masked"
HOME = "ring attention dK/dV home"
"""The detail of the ring's last transfer, made after every block is computed (bench_cp reads it)."""


# --- Ring attention ---------------------------------------------------------------------------------------


def pair_kind(q_chunk: int, kv_chunk: int) -> str:
    """How a query chunk sees a key chunk under the causal mask: full, diagonal (causal inside) or masked."""
    if kv_chunk < q_chunk:
        return FULL
    return DIAGONAL if kv_chunk == q_chunk else MASKED


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same rows by their log-sum-exps."""
    if out is None or lse is None:
        return o, lo
    new = torch.logaddexp(lse, lo)
    return out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(lo - new).unsqueeze(-1), new


def _exchange(split: ContextSplit, sends: list[torch.Tensor], detail: str) -> tuple[list, list[torch.Tensor]]:
    """Send each tensor to the next CP rank and receive one like it from the previous, asynchronously."""
    received = [torch.empty_like(t) for t in sends]
    ops = []
    for tag, (send, recv) in enumerate(zip(sends, received, strict=True)):
        ops.append(dist.P2POp(dist.isend, send, split.next_rank, split.group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, split.prev_rank, split.group, tag))
    return comm.batch_isend_irecv(ops, "cp", detail), received


def _chunks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two chunks of a rank's sequence dimension (-2)."""
    front, back = x.chunk(2, dim=-2)
    return front, back


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over the CP group; q (b, h, s, d), k/v (b, hk, s, d), this rank's two chunks.

    Each block runs kernels.flash_attention_block(_grads) with impl `impl`, given the chunks' global offsets;
    K/V travel in their own dtype, outputs and gradients are merged and accumulated in at least fp32."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        split: ContextSplit,
        scale: float,
        documents: torch.Tensor | None,
        impl: str,
    ) -> torch.Tensor:
        size = q.shape[2] // 2
        q_parts = _chunks(q)
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        kv = torch.stack((k, v))
        for step in range(split.cp):
            source = (split.rank - step) % split.cp
            pending: list = []
            if step < split.cp - 1:  # the next block travels while this one is computed
                pending, received = _exchange(split, [kv], f"ring attention K/V, step {step}")
            k_parts, v_parts = _chunks(kv[0]), _chunks(kv[1])
            for i, j, q_offset, k_offset, allowed in _visible_pairs(split, source, documents, size):
                o, lo = kernels.flash_attention_block(
                    q_parts[i], k_parts[j], v_parts[j], True, scale, q_offset, k_offset, impl, allowed=allowed
                )
                outs[i], lses[i] = _merge(outs[i], lses[i], o, lo)
            for work in pending:
                work.wait()
            if pending:
                kv = received[0]
        out = torch.cat(outs, dim=-2)  # type: ignore[arg-type]
        lse = torch.cat(lses, dim=-1)  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.split, ctx.scale, ctx.impl = split, scale, impl
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse, documents = ctx.saved_tensors
        split: ContextSplit = ctx.split
        size = q.shape[2] // 2
        dtype = out.dtype
        q_parts, do_parts, out_parts = _chunks(q), _chunks(dout), _chunks(out)
        lse_parts = lse.chunk(2, dim=-1)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dq_parts = _chunks(dq)
        kv = torch.stack((k, v))
        dkv: torch.Tensor | None = None  # gradient of the block in hand, from the ranks it has visited
        for step in range(split.cp):
            source = (split.rank - step) % split.cp
            sends = []
            if step < split.cp - 1:
                sends.append(kv)
            if dkv is not None:  # the previous block's gradient moves on with it
                sends.append(dkv)
            pending, received = _exchange(split, sends, f"ring attention backward, step {step}")
            own = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
            k_parts, v_parts = _chunks(kv[0]), _chunks(kv[1])
            dk_parts, dv_parts = _chunks(own[0]), _chunks(own[1])
            for i, j, q_offset, k_offset, allowed in _visible_pairs(split, source, documents, size):
                dq_ij, dk_ij, dv_ij = kernels.flash_attention_block_grads(
                    do_parts[i], q_parts[i], k_parts[j], v_parts[j], lse_parts[i], out_parts[i], True,
                    ctx.scale, q_offset, k_offset, ctx.impl, allowed=allowed,
                )  # fmt: skip
                dq_parts[i].add_(dq_ij)
                dk_parts[j].add_(dk_ij)
                dv_parts[j].add_(dv_ij)
            for work in pending:
                work.wait()
            if step < split.cp - 1:
                kv = received.pop(0)
            dkv = own if dkv is None else received[0] + own
        # After cp - 1 steps each rank holds the complete gradient of its successor's block: send it home.
        pending, received = _exchange(split, [dkv], HOME)
        for work in pending:
            work.wait()
        dkv = received[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _visible_pairs(
    split: ContextSplit, source: int, documents: torch.Tensor | None, size: int
) -> Iterator[tuple[int, int, int, int, torch.Tensor | None]]:
    """(local query chunk, source key chunk, their global offsets, same-document mask) of every pair of this
    rank's query chunks with `source`'s key chunks that the causal mask leaves anything of."""
    for i, qi in enumerate(chunk_ids(split.cp, split.rank)):
        for j, kj in enumerate(chunk_ids(split.cp, source)):
            if pair_kind(qi, kj) != MASKED:
                yield i, j, qi * size, kj * size, _allowed(documents, qi, kj, size)


def _allowed(documents: torch.Tensor | None, q_chunk: int, kv_chunk: int, size: int) -> torch.Tensor | None:
    """(b, n, m) same-document pairs of two chunks of `size` tokens; None without packed documents."""
    if documents is None:
        return None
    q_docs = documents[:, q_chunk * size : (q_chunk + 1) * size]
    return same_document(q_docs, documents[:, kv_chunk * size : (kv_chunk + 1) * size])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: ContextSplit,
    softmax_scale: float | None = None,
    documents: torch.Tensor | None = None,
    impl: str = "torch",
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys: q (b, heads, s, d), k/v
    (b, kv_heads, s, d), each this rank's two chunks (split_sequence) -> context (b, heads, s, d). With
    `documents` (b, S), the packed documents' ids of the whole sequences, only inside each document. Each
    block runs kernels.flash_attention_block with `impl`; packed documents always take the PyTorch path
    (the Triton kernels have no document mask), as the model's attention does without cp."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[2] % 2:
        raise ValueError(f"a CP rank holds two equal chunks; got {q.shape[2]} tokens")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    block_impl = "torch" if documents is not None else impl
    return _RingAttention.apply(q, k, v, split, scale, documents, block_impl)


# --- All-to-all (Ulysses) ---------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (cp equal pieces); its own adjoint, so backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, detail: str) -> torch.Tensor:
        ctx.group, ctx.detail = group, detail
        x = x.contiguous()
        out = torch.empty_like(x)  # like a contiguous x: empty_like keeps a transposed one's strides
        comm.all_to_all_single(out, x, group=group, detail=detail)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, group=ctx.group, detail=ctx.detail + " (backward)")
        return out, None, None


def _heads_to_sequence(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """(b, h, s, d) this rank's tokens of every head -> (b, h/cp, S, d) every token of this rank's heads."""
    b, h, s, d = x.shape
    pieces = x.reshape(b, split.cp, h // split.cp, s, d).transpose(0, 1)
    gathered = _AllToAll.apply(pieces, split.group, "all-to-all attention: heads to sequence")
    return merge_sequence(list(gathered.unbind(0)), dim=2)


def _sequence_to_heads(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The inverse of _heads_to_sequence: (b, h/cp, S, d) -> (b, h, s, d)."""
    b, hs, _, d = x.shape
    pieces = torch.stack([split_sequence(x, split.cp, r, dim=2) for r in range(split.cp)])
    back = _AllToAll.apply(pieces, split.group, "all-to-all attention: sequence to heads")
    return back.transpose(0, 1).reshape(b, split.cp * hs, -1, d)


def replicate_kv_heads(k: torch.Tensor, heads: int, cp: int) -> torch.Tensor:
    """k (b, kv_heads, s, d) with each head repeated so that cp divides their number (and it still divides
    `heads`): grouped-query K/V with fewer heads than CP ranks."""
    kv = k.shape[1]
    if kv % cp == 0:
        return k
    repeat = cp // math.gcd(kv, cp)
    if heads % (kv * repeat):
        raise ValueError(f"{heads} query heads cannot share {kv} kv heads replicated {repeat} times")
    return k.repeat_interleave(repeat, dim=1)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: ContextSplit,
    impl: str = "torch",
    documents: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention by head scattering: the same contract as ring_attention, with the whole sequence's
    attention for h/cp heads run by kernels.flash_attention(impl=`impl`) on each rank (inside documents:
    llmtrain.models.documents)."""
    heads = q.shape[1]
    if heads % split.cp:
        raise ValueError(
            f"all-to-all attention scatters {heads} heads over {split.cp} CP ranks; choose a cp dividing "
            "the heads per tensor-parallel rank, or parallel.cp_comm=ring"
        )
    k, v = replicate_kv_heads(k, heads, split.cp), replicate_kv_heads(v, heads, split.cp)
    full = [_heads_to_sequence(t, split) for t in (q, k, v)]
    if documents is None:
        out = kernels.flash_attention(*full, causal=True, softmax_scale=softmax_scale, impl=impl)
    else:
        out = document_attention(*full, documents, scale=softmax_scale)
    return _sequence_to_heads(out, split)


# --- Applying it ------------------------------------------------------------------------------------------


def _core(split: ContextSplit, impl: str, scale: float | None = None) -> Any:
    def core(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        if split.comm == "all_to_all":
            return all_to_all_attention(q, k, v, split, impl, documents, scale)
        return ring_attention(q, k, v, split, scale, documents, impl)

    return core


def context_split(topo: Topology, cp_comm: str = "ring") -> ContextSplit | None:
    """This rank's ContextSplit; None when cp is 1."""
    if topo.cp == 1:
        return None
    return ContextSplit(topo.cp, topo.cp_rank, topo.cp_group, topo.next_cp_rank, topo.prev_cp_rank, cp_comm)


def apply_cp(model: nn.Module, topo: Topology, cp_comm: str = "ring") -> nn.Module:
    """Split a CausalLM's sequences over the CP group in place: the model takes this rank's chunks of its
    inputs (`model.context`), every attention core attends across the split, and the loss is the whole
    sequence's. After apply_tp (heads are then this TP rank's), before apply_recompute."""
    split = context_split(topo, cp_comm)
    if split is None:
        return model
    model.context = split
    for block in model.blocks():
        if isinstance(block.attn, LatentAttention):  # its core pads the heads to one width, then attends
            block.attn.attention = _core(split, block.attn.impl, block.attn.softmax_scale)
        else:
            block.attn.core = _core(split, block.attn.impl)
        if isinstance(block.mlp, MoEMLP):
            block.mlp.register_forward_hook(functools.partial(_sum_router_stats, split))
            share_capacity(block.mlp, topo, split)
    return model


def _sum_router_stats(split: ContextSplit, mlp: MoEMLP, _args: Any, _out: torch.Tensor) -> None:
    mlp.stats = sum_router_stats(mlp.stats, split.group, split.cp)
