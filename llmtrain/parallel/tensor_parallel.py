"""Tensor and sequence parallelism applied from outside to a plain CausalLM (module names unchanged).

Megatron's layout: q/k/v, gate_up and up projections and the LM head are column-parallel (output features
split), o_proj and down_proj row-parallel (input features split, outputs summed over TP), the token embedding
vocab-parallel; latent attention's up-projections are split by heads and its down-projections replicated
(_shard_latent_attention), MoE layers route 1/tp of the sequence on each rank (_shard_moe). The communication
sits at the region boundaries: after each norm that feeds a column-parallel layer ("enter": identity forward /
all-reduce backward, or all-gather along the sequence with sequence parallelism) and inside the row-parallel
layers ("exit": all-reduce, or reduce-scatter with SP).

Each parameter gets attributes the rest of the package reads:
  tp_layout: how to reassemble the full tensor ("rows", "cols", "gate_up", ("kv", replicas)) or absent.
  duplicate: True when another rank holds the same values and counts them in the gradient norm.
  sequence_parallel: its gradient is partial per TP rank (SP regions, replicated weights feeding split ones)
    and is summed over TP before the update.
  kv_replicas: a kv-head slice held by `kv_replicas` consecutive TP ranks; their gradients are summed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.config.layout_rules import tensor_parallel_problem
from llmtrain.config.schema import ModelConfig
from llmtrain.config.validate import raise_if_problem
from llmtrain.models.mla import LatentAttention
from llmtrain.models.moe import MoEMLP, RouterStats, capacity_keep, expert_capacity
from llmtrain.parallel.comm import (
    all_gather_dim,
    all_gather_single,
    all_reduce,
    group_size,
    reduce_scatter_single,
)
from llmtrain.parallel.context_split import ContextSplit
from llmtrain.parallel.gemms import PLAIN, LinearGemms, linear
from llmtrain.parallel.random import RNGTracker
from llmtrain.parallel.topology import Topology


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % size:
        raise ValueError(f"sequence length {moved.shape[0]} is not divisible by the TP size {size}")
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    all_reduce(x, group=group)
    return x


class _CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (entering a TP region without SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward, identity backward (leaving a TP region without SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (entering a TP region with SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (leaving a TP region with SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _SplitSequence(torch.autograd.Function):
    """This rank's slice of a TP-replicated tensor along `dim` forward, all-gather backward (entering a
    region where TP ranks work on different tokens, without SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return x.chunk(group_size(group), dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherSplitSequence(torch.autograd.Function):
    """All-gather along `dim` forward, this rank's slice backward (leaving such a region: the gradient of
    the replicated result is the same on every TP rank, so nothing is summed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.chunk(group_size(ctx.group), ctx.dim)[dist.get_rank(ctx.group)].contiguous(), None, None


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity; the gradient is all-reduced over `group`."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over `group`; the gradient passes through."""
    return _ReduceFromRegion.apply(x, group)


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Concatenate the sequence shards of `group` along `dim`; the gradient is reduce-scattered."""
    return _GatherSequence.apply(x, dim, group)


def reduce_scatter_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Sum over `group` and keep this rank's sequence shard; the gradient is all-gathered."""
    return _ReduceScatterSequence.apply(x, dim, group)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*V/tp, (rank+1)*V/tp) of the token table; lookups outside them give zeros, summed over TP."""

    def __init__(self, full: nn.Embedding, topo: Topology, sequence_parallel: bool) -> None:
        super().__init__()
        self.group = topo.tp_group
        self.sequence_parallel = sequence_parallel
        rows = full.num_embeddings // topo.tp
        self.vocab_start = topo.tp_rank * rows
        self.num_embeddings, self.embedding_dim = rows, full.embedding_dim
        self.weight = nn.Parameter(full.weight.detach()[self.vocab_start : self.vocab_start + rows].clone())
        self.weight.tp_layout = "rows"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.group)
        return reduce_from_region(out, self.group)


class RowParallelLinear(nn.Module):
    """Input-feature slice of a Linear; outputs summed over TP (reduce-scattered with SP), + bias."""

    def __init__(self, full: nn.Linear, topo: Topology, sequence_parallel: bool) -> None:
        super().__init__()
        self.group = topo.tp_group
        self.sequence_parallel = sequence_parallel
        cols = full.in_features // topo.tp
        self.in_features, self.out_features = cols, full.out_features
        self.weight = nn.Parameter(
            full.weight.detach()[:, topo.tp_rank * cols : (topo.tp_rank + 1) * cols].clone()
        )
        self.weight.tp_layout = "cols"
        self.gemms: LinearGemms = PLAIN  # float8 ones under train.precision=fp8 (llmtrain.parallel.float8)
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        if self.bias is not None:
            _mark_replicated(self.bias, topo, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x, self.weight, None)
        out = (
            reduce_scatter_sequence(out, self.group)
            if self.sequence_parallel
            else reduce_from_region(out, self.group)
        )
        return out + self.bias if self.bias is not None else out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's product, before the sum over TP. A zero-bubble pipeline replaces it per instance to
        defer the weight gradient (llmtrain/pipeline/executor.py)."""
        return linear(x, weight, bias, self.gemms)


def _mark_replicated(p: nn.Parameter, topo: Topology, sequence_parallel: bool) -> None:
    p.duplicate = topo.tp_rank > 0
    p.sequence_parallel = sequence_parallel


class ColumnParallelLinear(nn.Module):
    """Row blocks (output features) of a Linear; its input is replicated over TP (or SP-gathered)."""

    def __init__(
        self,
        full: nn.Linear,
        blocks: list[tuple[int, int]],
        layout: Any,
        group: Any,
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        if weight is None:
            weight = nn.Parameter(torch.cat([full.weight.detach()[a:b] for a, b in blocks]).clone())
            weight.tp_layout = layout
        self.weight = weight
        self.gemms: LinearGemms = PLAIN  # float8 ones under train.precision=fp8 (llmtrain.parallel.float8)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(torch.cat([full.bias.detach()[a:b] for a, b in blocks]).clone())
            self.bias.tp_layout = layout
        self.in_features, self.out_features = full.in_features, self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's product; an SP all-gathered x keeps only its ``sequence_shard`` for backward
        (gemms.linear). A zero-bubble pipeline replaces it per instance to defer the weight gradient
        (pipeline/executor.py)."""
        return linear(x, weight, bias, self.gemms, getattr(x, "sequence_shard", None), self.group)


def check_tp(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Raise ConfigError when the model cannot be split over `tp` ranks (the rule and its message:
    llmtrain.config.layout_rules.tensor_parallel_problem)."""
    raise_if_problem(tensor_parallel_problem(cfg, tp, sequence_parallel))


def _enter_region(module: nn.Module, group: Any, sequence_parallel: bool) -> None:
    """After `module` (a norm feeding column-parallel layers): SP all-gather, else copy-to-region.

    A norm called with `residual=` returns (normed, residual sum): only `normed` enters the region,
    the residual stream stays replicated (or sequence-sharded with SP).
    """

    def region(normed: torch.Tensor) -> torch.Tensor:
        if not sequence_parallel:
            return copy_to_region(normed, group)
        gathered = gather_sequence(normed, group)
        # ColumnParallelLinear saves this shard instead of the gathered tensor (see gemms.linear).
        gathered.sequence_shard = normed
        return gathered

    def enter(_m: nn.Module, _inp: Any, out: Any) -> Any:
        return (region(out[0]), *out[1:]) if isinstance(out, tuple) else region(out)

    module.register_forward_hook(enter)


def _shard_attention(attn: nn.Module, topo: Topology, sp: bool) -> None:
    tp, r = topo.tp, topo.tp_rank
    d = attn.head_dim
    heads, kv = attn.num_heads, attn.num_kv_heads
    local_heads = heads // tp
    group = topo.tp_group
    attn.q_proj = ColumnParallelLinear(
        attn.q_proj, [(r * local_heads * d, (r + 1) * local_heads * d)], "rows", group
    )
    if kv % tp == 0:
        local_kv = kv // tp
        blocks = [(r * local_kv * d, (r + 1) * local_kv * d)]
        layout: Any = "rows"
        replicas = 1
    else:
        # tp > kv heads: each kv head serves tp/kv consecutive ranks (their query heads are its group).
        replicas = tp // kv
        local_kv = 1
        head = r // replicas
        blocks = [(head * d, (head + 1) * d)]
        layout = ("kv", replicas)
    attn.k_proj = ColumnParallelLinear(attn.k_proj, blocks, layout, group)
    attn.v_proj = ColumnParallelLinear(attn.v_proj, blocks, layout, group)
    for proj in (attn.k_proj, attn.v_proj):
        if replicas > 1:
            for p in proj.parameters():
                p.kv_replicas = replicas
                p.duplicate = r % replicas != 0
    attn.o_proj = RowParallelLinear(attn.o_proj, topo, sp)
    attn.num_heads, attn.num_kv_heads = local_heads, local_kv
    for norm in (attn.q_norm, attn.k_norm):  # QK-norm (qwen3_moe): one head_dim-wide weight for every head
        for p in norm.parameters() if norm is not None else ():
            # Each rank normalises its own heads, so its gradient is a partial sum: summed over TP as
            # sequence-parallel gradients are (reduce_tp_grads), and written once (the TP rank 0 copy).
            _mark_replicated(p, topo, True)


def _shard_latent_attention(attn: LatentAttention, topo: Topology, sp: bool) -> None:
    """Multi-head latent attention split by heads, as Megatron-Core splits it: the up-projections whose rows
    are per head ([nope | rope] queries of q_proj or q_b_proj, [nope | v] of kv_b_proj) column-parallel,
    o_proj row-parallel. The down-projections and their norms (q_a_proj, q_a_norm, kv_a_proj with the
    rotary key part every head shares, kv_a_norm) stay whole on every rank, which computes them for the
    whole sequence; each rank's gradient of them comes from its own heads only, so it is summed over TP
    as the SP regions' are."""
    r, group = topo.tp_rank, topo.tp_group
    local = attn.num_heads // topo.tp
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        full = getattr(attn, name)
        if full is None:
            continue
        rows = local * full.out_features // attn.num_heads
        setattr(attn, name, ColumnParallelLinear(full, [(r * rows, (r + 1) * rows)], "rows", group))
    for module in (attn.q_a_proj, attn.q_a_norm, attn.kv_a_proj, attn.kv_a_norm):
        for p in module.parameters() if module is not None else ():
            _mark_replicated(p, topo, True)
    attn.o_proj = RowParallelLinear(attn.o_proj, topo, sp)
    attn.num_heads = local


def _shard_mlp(mlp: nn.Module, topo: Topology, sp: bool) -> None:
    tp, r = topo.tp, topo.tp_rank
    if hasattr(mlp, "gate_up_proj"):
        ffn = mlp.gate_up_proj.out_features // 2
        f = ffn // tp
        # Matching gate and up slices, so the local chunk(2) pairs them.
        blocks = [(r * f, (r + 1) * f), (ffn + r * f, ffn + (r + 1) * f)]
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, blocks, "gate_up", topo.tp_group)
    else:
        f = mlp.up_proj.out_features // tp
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, [(r * f, (r + 1) * f)], "rows", topo.tp_group)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, topo, sp)


def sum_router_stats(s: RouterStats, group: Any, ranks: int) -> RouterStats:
    """Router statistics summed over the `ranks` ranks of `group`, which each routed a part of the same
    micro-batch (TP, CP), so the router losses see all of it; the gradient stays with this rank's tokens."""
    local = [s.tokens_per_expert, s.prob_sum, s.balance_tokens, s.z_sum[None], s.dropped[None]]
    pooled = reduce_from_region(torch.cat(local), group).split([t.numel() for t in local])
    return RouterStats(pooled[0], pooled[1], s.rows * ranks, pooled[2], pooled[3][0], pooled[4][0])


def _shard_moe(mlp: MoEMLP, topo: Topology, sp: bool) -> None:
    """An MoE layer under TP: its weights stay whole (experts are split by EP, if at all) and each TP rank
    routes its own 1/tp of the sequence -- the SP shard it already holds, or without SP its slice of the
    replicated input, gathered back afterwards -- so no token is routed twice. Routers and shared experts
    get partial gradients, summed over TP as SP regions' are; the router statistics are summed over TP so
    the router losses see the whole micro-batch (their gradient stays with each rank's own tokens). With
    model.moe_capacity_factor the capacity is that of the whole sequences (share_capacity)."""
    group = topo.tp_group
    for name, p in mlp.named_parameters():
        # Under EP the experts' gradients are summed over their expert-DP group, TP ranks included.
        if topo.ep == 1 or not name.startswith("experts."):
            _mark_replicated(p, topo, True)
    if not sp:
        mlp.register_forward_pre_hook(lambda _m, args: (_SplitSequence.apply(args[0], 1, group), *args[1:]))
    share_capacity(mlp, topo)

    def leave(m: MoEMLP, _args: Any, out: torch.Tensor) -> torch.Tensor:
        m.stats = sum_router_stats(m.stats, group, topo.tp)
        return out if sp else _GatherSplitSequence.apply(out, 1, group)

    mlp.register_forward_hook(leave)


def share_capacity(mlp: MoEMLP, topo: Topology, split: ContextSplit | None = None) -> None:
    """Make the TP ranks (and with `split` the CP ranks) routing parts of the same sequences drop what one
    process drops when it routes them whole (MoEMLP.keep_within_capacity); nothing without a capacity."""
    if mlp.capacity_factor is not None:
        mlp.keep_within_capacity = functools.partial(_keep_within_shared_capacity, mlp, topo, split)


@torch.no_grad()
def _keep_within_shared_capacity(
    mlp: MoEMLP,
    topo: Topology,
    split: ContextSplit | None,
    weights: torch.Tensor,
    experts: torch.Tensor,
    lead: torch.Size,
) -> torch.Tensor:
    """MoEMLP.keep_within_capacity of a rank routing TP chunk tp_rank of its (CP rank's part of the) (b, s)
    sequences: the routing decisions of the whole sequences are all-gathered (2k numbers a token, far less
    than the hidden states) and put in sequence order, the capacity is applied to them as one process
    would, and this rank keeps its own tokens' verdicts."""
    b, s = lead
    k = experts.shape[1]
    # Expert ids are exact in fp32 (well below 2**24): one all-gather carries both.
    mine = torch.cat([weights.float(), experts.float()], dim=-1).view(b, s, 2 * k)
    every = all_gather_dim(mine, 1, topo.tp_group)
    if split is not None:
        every = split.whole(every)
    n = mlp.experts.num_experts
    capacity = expert_capacity(mlp.capacity_factor, b * every.shape[1], k, n)
    flat = every.reshape(-1, 2 * k)
    keep = capacity_keep(flat[:, :k], flat[:, k:].long(), n, capacity).view(b, -1, k)
    if split is not None:
        keep = split.local(keep)
    return keep.chunk(topo.tp, 1)[topo.tp_rank].reshape(b * s, k)


def apply_tp(
    model: nn.Module, topo: Topology, sequence_parallel: bool = False, seed: int = 1234
) -> nn.Module:
    """Shard a CausalLM over the TP group in place; ranks keep slices of the same weights.

    Either every rank built the same full model (same seed), so the shards are exact slices of the
    single-process weights, or the model is on the meta device and the slices are meta tensors for
    llmtrain.parallel.materialize to allocate and fill. `seed` seeds the per-TP-rank dropout stream
    (attention heads, SP regions).
    """
    tp = topo.tp
    if tp == 1:
        return model
    cfg = model.config
    check_tp(cfg, tp, sequence_parallel)
    group, sp = topo.tp_group, sequence_parallel
    weight = model.embed_tokens.weight
    device = topo.device if weight.is_meta else weight.device
    # Megatron's offset: distinct from the default stream, different per TP rank and per pipeline stage.
    tracker = RNGTracker(seed + 2718 + topo.tp_rank + 100 * topo.pp_rank, device)
    model.tp_rng = tracker
    tied = model.lm_head.weight is model.embed_tokens.weight

    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, topo, sp)
    if model.embed_positions is not None:
        _mark_replicated(model.embed_positions.weight, topo, sp)
        if sp:

            def local_positions(_m: nn.Module, _inp: Any, out: torch.Tensor) -> torch.Tensor:
                per_rank = out.shape[-2] // tp
                return out[..., topo.tp_rank * per_rank : (topo.tp_rank + 1) * per_rank, :]

            model.embed_positions.register_forward_hook(local_positions)
    if sp:
        tracker.wrap(model.embed_dropout)

    for block in model.blocks():
        moe = isinstance(block.mlp, MoEMLP)
        for norm in (block.input_norm, block.post_attn_norm):
            for p in norm.parameters():
                _mark_replicated(p, topo, sp)
            if not (moe and norm is block.post_attn_norm):
                _enter_region(norm, group, sp)
        if isinstance(block.attn, LatentAttention):
            _shard_latent_attention(block.attn, topo, sp)
        else:
            _shard_attention(block.attn, topo, sp)
        if moe:
            _shard_moe(block.mlp, topo, sp)
        else:
            _shard_mlp(block.mlp, topo, sp)
        if sp:
            tracker.wrap(block.dropout)
        if block.attn.dropout_p > 0:
            block.attn.core = _forked(block.attn.core, tracker)

    for p in model.final_norm.parameters():
        _mark_replicated(p, topo, sp)
    _enter_region(model.final_norm, group, sp)
    for module in model.mtp.layers if model.mtp is not None else []:
        # Replicated like the norms: eh_proj (2 h x h) works on the residual stream's layout (whole, or
        # this rank's sequence shard with SP: partial gradients, summed over TP); final_norm feeds the head.
        for part in (module.enorm, module.hnorm, module.eh_proj, module.final_norm):
            for p in part.parameters():
                _mark_replicated(p, topo, sp)
        _enter_region(module.final_norm, group, sp)
    rows = cfg.vocab_size // tp
    model.lm_head = ColumnParallelLinear(
        model.lm_head,
        [(topo.tp_rank * rows, (topo.tp_rank + 1) * rows)],
        "rows",
        group,
        weight=model.embed_tokens.weight if tied else None,
    )
    # CausalLM.loss passes it to kernels.cross_entropy: vocab-parallel, the full logits are never gathered.
    model.loss_tp_group = group
    return model


def _forked(fn: Any, tracker: RNGTracker) -> Any:
    """`fn` run on the TP tracker's RNG stream (attention dropout differs per head shard)."""

    def call(*args: Any) -> Any:
        with tracker.fork():
            return fn(*args)

    return call


def _main_grad(p: nn.Parameter) -> torch.Tensor:
    return p.main_grad


def reduce_tp_grads(
    params: list[nn.Parameter],
    topo: Topology,
    grad_of: Callable[[nn.Parameter], torch.Tensor] = _main_grad,
) -> None:
    """Sum partial gradients over TP: SP-region replicas over the group, kv replicas over their block.
    ``grad_of`` gives the gradient tensor updated in place (flat-buffer ``main_grad``, or an FSDP shard:
    TP ranks hold equal-shaped tensors, so their DP shards cover the same elements)."""
    if topo.tp == 1:
        return
    group = topo.tp_group
    sp = [grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
    if sp:
        flat = torch.cat([g.reshape(-1) for g in sp])
        all_reduce(flat, group=group, detail="sequence-parallel gradients")
        torch._foreach_copy_(
            sp, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in sp]), sp, strict=True)]
        )
    kv = [p for p in params if getattr(p, "kv_replicas", 1) > 1]
    if kv:
        replicas = kv[0].kv_replicas
        grads = [grad_of(p) for p in kv]
        flat = torch.cat([g.reshape(-1) for g in grads])
        every = flat.new_empty(topo.tp * flat.numel())
        all_gather_single(every, flat, group=group, detail="kv-replica gradients")
        every = every.view(topo.tp, flat.numel())
        block = topo.tp_rank // replicas
        summed = every[block * replicas : (block + 1) * replicas].sum(0)
        torch._foreach_copy_(
            grads,
            [f.view_as(g) for f, g in zip(summed.split([g.numel() for g in grads]), grads, strict=True)],
        )


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
    """Full unsharded parameters and buffers under the single-process names (collective over the TP group,
    over DP for FSDP-sharded parameters and over EP for expert shards). Read through ``state_dict`` so
    parameter all-gathers still in flight (zero_stage 1) are waited for."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        layout = getattr(p, "tp_layout", None)
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if hasattr(p, "expert_slice"):  # EP ranks hold consecutive experts, in EP-rank order
            out[name] = all_gather_dim(t, 0, topo.ep_group).clone()
            continue
        if layout is None or topo.tp == 1:
            out[name] = t.clone()
            continue
        parts = list(all_gather_dim(t, 0, topo.tp_group).chunk(topo.tp, dim=0)) if layout != "cols" else None
        if layout == "cols":
            out[name] = all_gather_dim(t, t.dim() - 1, topo.tp_group).clone()
        elif layout == "rows":
            out[name] = torch.cat(parts).clone()
        elif layout == "gate_up":
            halves = [part.chunk(2) for part in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            replicas = layout[1]
            out[name] = torch.cat(parts[::replicas]).clone()
    return out
