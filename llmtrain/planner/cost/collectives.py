"""The communication one training step issues on one rank, as the cost model counts it.

Each entry is an operation (all_reduce, all_gather, reduce_scatter, all_to_all, send), the parallel
dimensions of its group that have more than one rank ("tp", "dp", "tp+pp", ...; the expert-parallel groups
are "ep" and "edp", the expert-data-parallel group), the group's size and the bytes of the full buffer (the
all-reduced tensor, the all-gather's output, the reduce-scatter's input, the all-to-all's input, the sent
tensor).
tests/planner/test_collectives.py traces what the trainer issues on gloo and compares the two.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from llmtrain.config.engine_rules import small_gemm
from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cost import flops as F


@dataclass(frozen=True)
class Comm:
    """One collective or send of a rank: operation, group dimensions, group size and full-buffer bytes."""

    op: str
    group: str
    size: int
    nbytes: int


@dataclass(frozen=True)
class PassComms:
    """The collectives of one layer (or stage extra) for one micro-batch, in its forward and its backward."""

    fwd: tuple[Comm, ...] = ()
    bwd: tuple[Comm, ...] = ()


COLUMN_PARALLEL_PER_LAYER = 4
"""Column-parallel linears fed by a layer's two TP regions: q, k and v (separate projections) after the
input norm, the (fused gate-up, or up) projection after the post-attention norm. Under sequence parallelism
each keeps only the sequence shard of its input and all-gathers it again in the backward
(llmtrain.parallel.gemms.linear)."""


def _gather_scatter(tp: int, activation: int) -> tuple[Comm, Comm]:
    return Comm("all_gather", "tp", tp, activation), Comm("reduce_scatter", "tp", tp, activation)


def tp_layer(
    tp: int,
    activation: int,
    sp: bool,
    recompute: str,
    moe: bool = False,
    latent: bool = False,
    regather: bool = True,
    gathered: int | None = None,
) -> PassComms:
    """One transformer layer's TP collectives on an `activation`-byte (b*s*h) input.

    Without SP: the region entries all-reduce the input gradient in the backward (2) and the region exits
    (o_proj, down_proj) all-reduce the output in the forward (2). With SP: the entries all-gather the
    sequence in the forward and reduce-scatter its gradient in the backward, the exits reduce-scatter in
    the forward and all-gather the gradient in the backward, and the 4 column-parallel linears re-gather
    their input in the backward: 2 all-gathers + 2 reduce-scatters forward, 6 + 2 backward. Full
    recomputation runs the forward's collectives again in the backward; torchtitan's op-level selective
    recomputation (selective_op) all but the reduce-scatters, whose outputs its policy saves.

    `moe`: the MLP is a mixture of experts, which is not a TP region (tensor_parallel._shard_moe): with SP
    it routes the sequence shard the rank holds (no collective); without SP each rank routes its slice of
    the replicated input and all-gathers the outputs (the slice's backward all-gathers the gradient). The
    attention region stays, with its 3 column-parallel q, k, v.

    `latent`: the attention is multi-head latent attention (deepseek_v3), whose column-parallel
    up-projections take the latents of its whole down-projections, not the gathered input: under SP they
    re-gather nothing (llmtrain.parallel.tensor_parallel._shard_latent_attention).

    `regather` false: the column-parallel linears save the input their region gathered, as DTensor's
    PrepareModuleInput + ColwiseParallel do in torchtitan (the gathered tensor is what autograd keeps for the
    weight gradient), so the backward re-gathers nothing: 2 all-gathers + 2 reduce-scatters each way.
    `gathered`: the bytes of each all-gathered tensor where they differ from `activation` (float8 tensor
    parallelism gathers 1 byte an element, Software.float8_tp); the reduce-scatters keep `activation`."""
    if tp == 1:
        return PassComms()
    regions = 1 if moe else 2
    if sp:
        gather, scatter = (
            Comm("all_gather", "tp", tp, activation if gathered is None else gathered),
            Comm("reduce_scatter", "tp", tp, activation),
        )
        column = COLUMN_PARALLEL_PER_LAYER - (1 if moe else 0) - (3 if latent else 0) if regather else 0
        fwd = (gather,) * regions + (scatter,) * regions
        bwd = (gather,) * (regions + column) + (scatter,) * regions
    else:
        fwd = bwd = (Comm("all_reduce", "tp", tp, activation),) * regions
        if moe:
            fwd = bwd = (*fwd, Comm("all_gather", "tp", tp, activation))
    if recompute == "selective_op":  # torchtitan's op-level policy saves the reduce-scatters' outputs
        return PassComms(fwd, tuple(c for c in fwd if c.op != "reduce_scatter") + bwd)
    return PassComms(fwd, fwd + bwd if recompute == "full" else bwd)


def tp_embedding(tp: int, activation: int, sp: bool) -> PassComms:
    """The vocab-parallel embedding: its output summed over TP (reduce-scattered with SP, whose backward
    all-gathers the gradient)."""
    if tp == 1:
        return PassComms()
    if sp:
        return PassComms(
            (Comm("reduce_scatter", "tp", tp, activation),), (Comm("all_gather", "tp", tp, activation),)
        )
    return PassComms((Comm("all_reduce", "tp", tp, activation),))


def tp_head(tp: int, activation: int, tokens: int, sp: bool) -> PassComms:
    """Final norm into the vocab-parallel output layer, and the vocab-parallel cross-entropy: the region
    entry as in a layer (one column-parallel linear) plus the loss's two fp32 all-reduces (row max; sum of
    exponentials with the target logit) of b*s rows."""
    if tp == 1:
        return PassComms()
    loss = (Comm("all_reduce", "tp", tp, 4 * tokens), Comm("all_reduce", "tp", tp, 8 * tokens))
    if sp:
        gather, scatter = (
            Comm("all_gather", "tp", tp, activation),
            Comm("reduce_scatter", "tp", tp, activation),
        )
        return PassComms((gather, *loss), (gather, scatter))
    return PassComms(loss, (Comm("all_reduce", "tp", tp, activation),))


TOKEN_ID_BYTES = 8
"""Bytes of a token id or label as the data loader hands them over (int64)."""


def vocab_sharded_edges(dp: int, activation: int, tokens: int) -> tuple[PassComms, PassComms]:
    """The embedding's and the output layer's traffic per micro-batch when they stay vocabulary-sharded over
    the `dp` ZeRO ranks (llmtrain.parallel.vocab_sharded), for a rank's `tokens` and `activation` bytes:
    the embedding all-gathers the group's ids and reduce-scatters the looked-up rows (its backward
    all-gathers their gradient); the head all-gathers the final hidden states and the labels, runs the
    vocab-parallel cross-entropy's two fp32 all-reduces over the group's tokens, and reduce-scatters the
    hidden states' gradient."""
    ids = Comm("all_gather", "dp", dp, TOKEN_ID_BYTES * tokens * dp)
    gather = Comm("all_gather", "dp", dp, activation * dp)
    scatter = Comm("reduce_scatter", "dp", dp, activation * dp)
    loss = (Comm("all_reduce", "dp", dp, 4 * tokens * dp), Comm("all_reduce", "dp", dp, 8 * tokens * dp))
    return PassComms((ids, scatter), (gather,)), PassComms((gather, ids, *loss), (scatter,))


def edge_layers(
    tp: int, sp: bool, vocab_dp: int, activation: int, tokens: int
) -> tuple[PassComms, PassComms]:
    """The embedding's and the output layer's (with the loss) collectives per micro-batch: vocabulary-sharded
    over `vocab_dp` ZeRO ranks when it is above 1 (llmtrain.config.vocab_sharding), else vocab-parallel over
    tp."""
    if vocab_dp > 1:
        return vocab_sharded_edges(vocab_dp, activation, tokens)
    return tp_embedding(tp, activation, sp), tp_head(tp, activation, tokens, sp)


RING_BYTES = 4
"""Bytes per element ring attention sends: it computes, and passes K/V and dK/dV around, in at least fp32
(llmtrain.parallel.context_parallel._compute_dtype)."""


def cp_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads an all-to-all scatters over cp ranks: repeated up to a multiple of cp when fewer divide
    (llmtrain.parallel.context_parallel.replicate_kv_heads)."""
    return kv_heads if kv_heads % cp == 0 else kv_heads * (cp // math.gcd(kv_heads, cp))


def cp_layer(
    cp: int, comm: str, tokens: int, heads: int, kv_heads: int, head_dim: int, act_bytes: int, recompute: str
) -> PassComms:
    """One layer's context-parallel traffic for a rank's `tokens` (its share of the micro-batch), `heads`
    and `kv_heads` of one TP rank.

    ring: the rank's K/V block (fp32) goes to the next CP rank at each of the cp - 1 forward steps; the
    backward sends it again cp - 1 times and the dK/dV that travel with it cp times (the last brings them
    home): 2cp - 1 sends of one block. all_to_all: q, k, v (K/V heads replicated to a multiple of cp) and
    the output, each one all-to-all of the rank's tokens x heads, in the forward and again in the
    backward. Recomputation (selective: the attention core; full: the layer) repeats the forward's."""
    if cp == 1:
        return PassComms()
    if comm == "ring":
        send = Comm("send", "cp", 2, 2 * tokens * kv_heads * head_dim * RING_BYTES)
        fwd, bwd = (send,) * (cp - 1), (send,) * (2 * cp - 1)
    else:
        q = Comm("all_to_all", "cp", cp, tokens * heads * head_dim * act_bytes)
        kv = Comm("all_to_all", "cp", cp, tokens * cp_kv_heads(kv_heads, cp) * head_dim * act_bytes)
        fwd = bwd = (q, kv, kv, q)
    return PassComms(fwd, fwd + bwd if recompute in ("selective", "full") else bwd)


COUNT_BYTES = 8
"""Bytes of one per-expert row count the EP ranks exchange (int64)."""


def routed_rows(tokens: int, top_k: int, tp: int) -> int:
    """Rows a rank routes in a MoE layer for its `tokens` (its CP share of the micro-batch): top-k per token
    of the 1/tp of them its TP rank routes (llmtrain.parallel.tensor_parallel._shard_moe: the sequence
    shard it holds under SP, else its slice of the replicated input), dropless."""
    return tokens // tp * top_k


def ep_layer(ep: int, experts: int, rows: int, row_bytes: int, recompute: str) -> PassComms:
    """One MoE layer's expert-parallel traffic for a rank's `rows` routed rows (routed_rows) of `row_bytes`
    each (llmtrain.parallel.expert_parallel.ExpertDispatch).

    Forward: the per-expert counts (all_to_all of `experts` int64), the dispatch of the rows to the ranks
    holding their experts and the combine that brings their outputs back; backward: the reverse exchanges
    of their gradients. Bytes are what the rank sends (the all-to-all's input): all its rows for the
    dispatch and the combine's backward, the rows it received for the other two, as many under balanced
    routing (the planner's assumption; summed over the EP group the two are equal under any routing).
    Full recomputation runs the forward's again in the backward."""
    if ep == 1:
        return PassComms()
    counts = Comm("all_to_all", "ep", ep, COUNT_BYTES * experts)
    exchange = Comm("all_to_all", "ep", ep, rows * row_bytes)
    fwd, bwd = (counts, exchange, exchange), (exchange, exchange)
    return PassComms(fwd, fwd + bwd if recompute == "full" else bwd)


def expert_groups(tp: int, cp: int, dp: int, ep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global ranks (of one pipeline stage, the default tp-cp-dp order) of the first EP group and of the
    first expert-data-parallel group, as llmtrain.parallel.topology carves them: expert-domain index
    dp_rank + dp * (cp_rank + cp * tp_rank), EP groups runs of ep consecutive indices, the expert-DP group
    the indices ep apart."""

    def rank(index: int) -> int:
        d, c, t = index % dp, index // dp % cp, index // (dp * cp)
        return t + tp * (c + cp * d)

    ep_group = tuple(sorted(rank(i) for i in range(ep)))
    return ep_group, tuple(sorted(rank(i) for i in range(0, tp * cp * dp, ep)))


def expert_dp_peers(tp: int, cp: int, dp: int, ep: int) -> list[str]:
    """The other members of rank 0's expert-data-parallel group (expert_groups), each named by the parallel
    dimensions in which it differs from rank 0 ("tp", "dp", "cp+dp", ...), as point-to-point sends are."""
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    names = []
    for r in expert_groups(tp, cp, dp, ep)[1][1:]:
        coords = {"tp": r % tp, "cp": r // tp % cp, "dp": r // (tp * cp)}
        names.append(group_name(tuple(d for d in DIMS if coords.get(d)), sizes))
    return names


@functools.lru_cache(maxsize=4096)  # asked for every layout the search evaluates
def expert_group_strides(tp: int, cp: int, dp: int, ep: int, devices_per_node: int) -> tuple[int, int]:
    """(EP group, expert-DP group): the stride (cluster.ClusterView's `stride` argument) that puts as many
    of each group's members on one node as the trainer's placement does (expert_groups: EP inside the DP
    ranks, or spanning CP or TP ranks, whose members are not evenly spaced); 1 for a group inside a node."""
    strides = []
    for ranks in expert_groups(tp, cp, dp, ep):
        nodes = Counter(r // devices_per_node for r in ranks)
        strides.append(1 if len(nodes) == 1 else max(devices_per_node // min(nodes.values()), 1))
    return strides[0], strides[1]


def ep_placement(tp: int, cp: int, dp: int, ep: int) -> str:
    """Where the trainer carves the ep ranks out of tp x cp x dp (llmtrain.parallel.topology), in words."""
    if dp % ep == 0:
        return f"inside the {dp} data-parallel ranks"
    if ep % dp == 0 and cp % (ep // dp) == 0:
        return f"over the {dp} data-parallel ranks and {ep // dp} of the {cp} context-parallel ranks"
    return f"over the {dp * cp} data x context-parallel ranks and {ep // (dp * cp)} of the {tp} TP ranks"


def router_stats(experts: int, tp: int, cp: int, recompute: str) -> PassComms:
    """One MoE layer's router statistics summed after its forward over the TP ranks, then the CP ranks, each
    of which routed a part of the micro-batch (llmtrain.parallel.tensor_parallel.sum_router_stats): loads,
    probability sums and balance counts per expert, the z-loss sum and the dropped count, 3E + 2 fp32.
    Identity in the backward; full recomputation runs the forward's again."""
    nbytes = 4 * (3 * experts + 2)
    fwd = tuple(Comm("all_reduce", d, size, nbytes) for d, size in (("tp", tp), ("cp", cp)) if size > 1)
    return PassComms(fwd, fwd if recompute == "full" else ())


def cp_loss(cp: int) -> PassComms:
    """The loss of a context-parallel micro-batch: its labelled-token count and each rank's weighted share
    summed over the CP group (fp32 scalars; llmtrain.parallel.context_split.ContextSplit.reduce_loss)."""
    if cp == 1:
        return PassComms()
    return PassComms((Comm("all_reduce", "cp", cp, 4),) * 2)


DIMS = ("tp", "cp", "pp", "dp")
"""The parallel dimensions in the order group names list them."""


def group_name(dims: tuple[str, ...], sizes: dict[str, int]) -> str:
    """A group's name: the dimensions it spans that have more than one rank, in tp, cp, pp, dp order."""
    return "+".join(d for d in DIMS if d in dims and sizes.get(d, 1) > 1)


def buckets(numel: int, bucket_numel: int) -> int:
    """Buckets of a flat gradient buffer of `numel` elements filled to at least `bucket_numel` each.

    The trainer closes a bucket at the first parameter that takes it to `bucket_numel` or more
    (llmtrain.parallel.data_parallel.GradBuffers), so its buckets exceed the size by less than one
    parameter, the last holds the rest; counted here as numel // bucket_numel (at least 1) equal buckets.
    """
    return max(1, numel // bucket_numel)


def rank_parameters(model: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> tuple[int, int]:
    """(parameters, of which TP-replicated under sequence parallelism) one TP rank holds for `layers`
    layers plus the embedding (`first`) and the final norm and untied output layer (`last`): q heads,
    MLP columns and vocabulary rows split over tp, each rank holding max(kv/tp, 1) kv heads; norms, the
    row-parallel biases and the learned position table replicated; QK-norms and latent attention's
    down-projections whole (flops.attention_whole_parameters), its up-projections and o_proj split by
    heads."""
    h, d, v = model.hidden_size, model.head_size, model.vocab_size
    a, kv = model.num_attention_heads // tp, max(model.kv_heads // tp, 1)
    norm = 2 * h if model.arch == "gpt" else h
    whole = F.attention_whole_parameters(model)
    if model.arch == "deepseek_v3":
        attn = (F.latent_attention_parameters(model) - whole) // tp + whole
    else:
        attn = h * (a + 2 * kv) * d + a * d * h + ((a + 2 * kv) * d if model.bias else 0) + whole
    mlp = _dense_mlp_parameters(model, tp)
    replicated_layer = 2 * norm + (2 * h if model.bias else 0)
    total = layers * (attn + mlp + replicated_layer)
    replicated = layers * replicated_layer
    if first:
        positions = model.max_positions * h if model.arch == "gpt" else 0
        total += v // tp * h + positions
        replicated += positions
    if last:
        total += norm + (0 if model.tied_embeddings and first else v // tp * h)
        replicated += norm
    return total, replicated


def kv_replica_parameters(model: ModelConfig, tp: int) -> int:
    """One layer's k/v projection parameters on a TP rank when tp exceeds the kv heads (each kv head is
    then replicated on tp / kv ranks, their gradients summed over TP); 0 otherwise (and for latent
    attention, which has no kv heads to split)."""
    if tp <= model.kv_heads or model.arch == "deepseek_v3":
        return 0
    h, d = model.hidden_size, model.head_size
    return 2 * h * d + (2 * d if model.bias else 0)


def _dense_mlp_parameters(model: ModelConfig, tp: int) -> int:
    """A dense MLP's column- and row-parallel weights (and column biases) on one TP rank."""
    h, f, gated = model.hidden_size, model.ffn_size, F.is_gated(model)
    return (3 if gated else 2) * h * f // tp + (((2 if gated else 1) * f // tp) if model.bias else 0)


FLOAT8_SCALE_BYTES = 4
"""A float8 weight's scale (fp32): all-reduced (its amax, MAX) once a step under train.fp8_all_gather."""


def float8_linear_shapes(model: ModelConfig, moe: bool) -> list[tuple[int, int, str]]:
    """(out, in) features of one layer's linears that llmtrain.parallel.float8 may run in float8, whole
    (tp 1), with how TP splits each: "col" (out), "row" (in), or "whole" (latent attention's replicated
    down-projections, a MoE layer's shared experts). The attention projections and the dense MLP or a MoE
    layer's shared experts; the router and the routed experts' grouped GEMM are not linear layers, biases
    and norms not GEMM operands."""
    h = model.hidden_size
    a = model.num_attention_heads
    if model.arch == "deepseek_v3":
        nope, rope, v, kv = (
            model.qk_nope_head_dim,
            model.qk_rope_head_dim,
            model.v_head_dim,
            model.kv_lora_rank,
        )
        rank = model.q_lora_rank
        query = (
            [(a * (nope + rope), h, "col")]
            if not rank
            else [(rank, h, "whole"), (a * (nope + rope), rank, "col")]
        )
        attn = [*query, (kv + rope, h, "whole"), (a * (nope + v), kv, "col"), (h, a * v, "row")]
    else:
        d, kv_heads = model.head_size, model.kv_heads
        attn = [(a * d, h, "col"), (kv_heads * d, h, "col"), (kv_heads * d, h, "col"), (h, a * d, "row")]
    width = 2 if F.is_gated(model) else 1
    if not moe:
        return [*attn, (width * model.ffn_size, h, "col"), (h, model.ffn_size, "row")]
    shared = model.num_shared_experts * model.expert_ffn_size
    return [*attn, (2 * shared, h, "whole"), (h, shared, "whole")] if shared else attn


def float8_layer_weights(model: ModelConfig, moe: bool, recipe: str, fp8_filter: str) -> tuple[int, int]:
    """(linear layers, weight elements) of one layer that llmtrain.parallel.float8 runs in float8, whole:
    float8_linear_shapes, less those train.fp8_filter=auto keeps bf16 (engine_rules.small_gemm, judged by
    the full weight shape as the runtime judges it)."""
    kept = [
        (n, k)
        for n, k, _ in float8_linear_shapes(model, moe)
        if fp8_filter != "auto" or not small_gemm(recipe, n, k)
    ]
    return len(kept), sum(n * k for n, k in kept)


def moe_layer_parameters(model: ModelConfig, tp: int, ep: int) -> tuple[int, int, int]:
    """(parameters beyond the dense layer rank_parameters counts, routed experts, gradients summed over TP)
    of one MoE layer on one rank: the router and shared experts (gated, no biases) in place of the dense
    MLP, and the rank's num_experts / ep routed experts, reduced apart over the expert-data-parallel group.
    Every TP rank holds them whole and routes its share of the sequence, so at tp > 1 the router's, the
    shared experts' and (at ep = 1) the routed experts' gradients are partial sums over TP
    (llmtrain.parallel.tensor_parallel._shard_moe)."""
    h, fe = model.hidden_size, model.expert_ffn_size
    router_shared = model.num_experts * h + 3 * h * fe * model.num_shared_experts
    routed = model.num_experts // ep * 3 * h * fe
    partial = (router_shared + (routed if ep == 1 else 0)) if tp > 1 else 0
    return router_shared - _dense_mlp_parameters(model, tp), routed, partial


def muon_layer_parameters(model: ModelConfig, moe: bool) -> int:
    """The whole (un-split) elements of one layer's matrices train.optimizer=muon orthogonalises
    (llmtrain.parallel.muon.muon_updates): the attention projections and the MLP's, every routed expert's
    and shared expert's; not the norms, biases or router, which AdamW keeps."""
    h, d, a = model.hidden_size, model.head_size, model.num_attention_heads
    if model.arch == "deepseek_v3":
        attn = F.latent_projection_params(model) + a * model.v_head_dim * h
    else:
        attn = h * (a + 2 * model.kv_heads) * d + a * d * h
    if moe:
        return attn + 3 * h * model.expert_ffn_size * (model.num_experts + model.num_shared_experts)
    return attn + (2 if model.arch == "gpt" else 3) * h * model.ffn_size
