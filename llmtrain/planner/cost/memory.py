"""Per-rank memory of one layout: model state, activations, gathered and communication buffers, startup.

Model state per parameter on the rank (P: its parameters after the TP and PP splits; N: the shard group,
(parallel.dp_shard under hybrid sharding, else dp) x cp; e: bytes of a 16-bit or fp32 weight; g: gradient
bytes, fp32 main gradients by default):

    zero 0  params e*P   grads g*P    optimizer (8 + master)*P      (master: 4 in bf16/fp16, 0 in fp32)
    zero 1  params e*P   grads g*P    optimizer (8 + master)*P/N    (Megatron's distributed optimizer)
    zero 2  params e*P   grads g*P/N  optimizer 12*P/N              (FSDP2 without resharding after forward:
                                                                     the gathered compute copy lives through
                                                                     the step, the fp32 shard is the master)
    zero 3  params 4*P/N grads g*P/N  optimizer 8*P/N               (FSDP2: the fp32 shard is the parameter
                                                                     and the master; blocks are gathered)

Context parallelism (cp): ranks hold the same parameters as data-parallel ones, so the shard group is dp x cp,
and every token-sized term (activations, logits, sends, buffers) counts the rank's s/cp tokens; ring
attention also keeps its fp32 output and log-sum-exp. Mixture of experts: a layer's parameters are its
replicated part (attention, norms, router, shared experts, averaged over the layers) and its routed experts,
divided by ep (whole on every TP rank, as routers, shared experts and latent attention's down-projections
are); from zero 1 on the experts' state shards over the expert-data-parallel group (tp x cp x dp / ep:
expert_shard_group); a MoE layer's activations keep per routed row (top-k per token) the dispatched input,
the expert's output and the gated MLP's intermediates (moe_mlp_saved_per_token).

The zero 2/3 gradient row at the step's peak, the backward's start, is the shard only with gradient
accumulation (parallel.grad_reduce=microbatch: the earlier micro-batches' gradients reduce-scattered into
it); with one micro-batch per step it is none (the reduce-scatters create the shards as the backward frees
the activations, and zero_grad dropped the last step's); with grad_reduce=step FSDP2 keeps the earlier
micro-batches' gradients unsharded in fp32 (the trainer turns gradient sync off until the last
micro-batch), 4*P, but for vocabulary-sharded edges (never gathered, so reduced at once). Measured
(benchmarks/bench_memory.py, two micro-batches): dp2-zero3-step peaks 244.3 MiB, dp2-zero3 238.6, predicted
247.6 and 242.0.

Muon (train.optimizer=muon, llmtrain.parallel.muon): the blocks' matrices (a layer's parameters; its norms,
biases and router are a rounding error beside them) keep one fp32 momentum buffer, 4*P/N, where AdamW keeps
two moments, 8*P/N; embeddings and the output layer stay on AdamW. Each step assembles the stage's matrices
whole, in fp32, in one buffer: 4 bytes times the layers' parameters of the stage at their full (un-split)
size, counted in buffers.

Offload (zero 2/3, as DeepSpeed's ZeRO-Offload or FSDP2's CPUOffloadPolicy): "optimizer" moves the optimizer
rows (master and Adam moments) and, at zero 2/3, the gradient shard to host memory; "optimizer+params"
(zero 3) moves the fp32 parameter shard too. Host bytes are reported apart and never count against the device.

Gathered buffers: ZeRO-3 holds the unsharded 16-bit parameters of the block being computed and of the
prefetched ones (Software.zero3_prefetch; at the peak, the output layer's backward, the next is a layer) plus,
in the backward, the unsharded gradient of one block before its reduce-scatter; ZeRO-2 holds that unsharded
gradient; at zero 0/1 the same place is taken by the weight gradient autograd produces before a hook adds it
into the flat main gradient. The largest block (a layer, the embedding or the output layer) sizes them.

Pipelines: the measured peaks that the model once missed (pp=2 interleaved 0.81, zb_h1 0.72) were, by
MemTracker's categories, not activations but backward temporaries ("Temp": 11-47 MiB at the peak) and, for
zb_h1, the inputs deferred weight gradients keep (below). The rest of the interleaved gap (0.855 on its last
rank) grew through the step: llmtrain's executor on gloo keeps every micro-batch's transfers until the step's
end (Software.p2p_held_until_step_end; traced per action: the last rank's live bytes rose by five activations
of one micro-batch, 2.5 MiB, per micro-batch, its received inputs, the gradients it sent back and the output
it sent on; 1f1b's last rank, receiving one input and sending its gradient, by two). Counted in buffers.

Activations (llmtrain's fused kernels; PyTorch's reference ops save a little more, see
activation_bytes_per_layer): Korthikanti et al. 2022 per layer (generalised to GQA, gated MLPs, flash
attention; recompute none/selective/full; sequence parallelism) times the layers of a rank's chunk times the
micro-batches the schedule keeps in flight on that rank (pipeline_time's peak: 1f1b pp, interleaved more,
zb_h1 as 1f1b, gpipe all), plus the last stage's logits. zb_h1 also defers rank r's weight gradients by r
micro-batches: each owed one keeps its layers' linear inputs and output gradients and, on the last stage, the
logits' gradient (measured: the 24 MiB the pp=2 zb_h1 full-recompute row missed on its last rank, 16 MiB of
them that fp32 logits' gradient of 512 tokens x 8192 words).

Buffers: the pipeline's send and receive of one micro-batch's activation and sequence parallelism's gathered
layer input; under offload, DeepSpeed's contiguous gradient bucket (parallel.dp_bucket_mb). Data-parallel
reductions run in place on the flat gradient buffer (NCCL), except gloo's ZeRO-1 shard exchange
(Software.gloo_shard_exchange), whose received copies outlive the activations.

Startup peak: with sharded construction (llmtrain.parallel.materialize) a rank allocates and initialises only
its own TP slice of its own stages, in fp32 (one row block at a time beyond that), then keeps those modules
while it copies them into the flat parameter and gradient buffers (and, in 16-bit training, the exact fp32
initial values for the master copy): 4P + held. At zero 2/3 it still materialises the whole TP-local model
before FSDP2 cuts its fp32 shards from it: 4P + 4P/N (once materialisation is shard-only: 4P/N plus one
block). Without sharded construction (Software.whole_model_init) every rank first builds the whole model in
fp32 (4 bytes x all parameters, plus the TP slice cut from it). Offload runs through the DeepSpeed engine,
which is handed the model built whole in fp32 (4 x all parameters) and flattens it into a contiguous copy
(e x P) before its fp32 master and gradient partitions exist ((4 + g) x P/N, host bytes).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import get_args

from llmtrain.config.schema import GradReduce, ModelConfig
from llmtrain.config.vocab_sharding import vocab_sharded_edges
from llmtrain.pipeline.partition import partition_layers
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.layout import Layout, Software
from llmtrain.planner.cost.pipeline_time import REPLAYED, peak_inflight_closed, replayed_peaks

# llmtrain.models.init.BLOCK_NUMEL, the elements drawn at once by the initialisation; repeated here so the
# planner needs no torch (tests/planner/test_memory_model.py checks the two agree).
INIT_BLOCK_NUMEL = 1 << 16

OFFLOADS = ("none", "optimizer", "optimizer+params")
"""CPU offload choices: nothing, the optimizer state (and gradient shard), or that plus the parameters."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank (device memory unless said otherwise)."""

    params: float
    """Parameters as stored (16-bit compute copies at zero 0-2, the fp32 shard at zero 3)."""
    grads: float
    """Main gradients (full at zero 0/1, the rank's shard at zero 2/3)."""
    optimizer: float
    """fp32 master weights (16-bit training) and Adam's two moments, sharded from zero 1 on."""
    activations: float
    """Saved activations of the micro-batches in flight, and the last stage's logits."""
    gathered: float
    """Unsharded parameters and gradients of the blocks in flight (zero 2/3); one block's weight gradient
    before it joins the main gradient (zero 0/1)."""
    buffers: float
    """Communication buffers: pipeline sends, data-parallel buckets, the sequence-parallel gather."""
    reserved: float
    """The device's runtime context, workspaces and fragmentation (cluster file)."""
    startup: float
    """Peak while the model is built and sharded, before the first step (reserved included)."""
    host: float
    """Bytes offloaded to host (CPU) memory."""

    @property
    def steady(self) -> float:
        """Peak during training steps."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.gathered
            + self.buffers
            + self.reserved
        )

    @property
    def peak(self) -> float:
        """The rank's peak over the whole run: the larger of startup and steady state."""
        return max(self.steady, self.startup)

    def as_dict(self) -> dict[str, float]:
        """Rows by name, plus steady, startup, host and total (the peak), in bytes."""
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "gathered": self.gathered,
            "buffers": self.buffers,
            "reserved": self.reserved,
            "steady": self.steady,
            "startup": self.startup,
            "host": self.host,
            "total": self.peak,
        }


def activation_bytes_per_layer(
    model: ModelConfig,
    seq: int,
    act_bytes: int,
    flash_attention: bool,
    tp: int,
    b: int,
    sp: bool,
    recompute: str,
    fused_kernels: bool = True,
    ring_attention: bool = False,
    moe_imbalance: float = 1.0,
    float8_inputs: bool = False,
    gathered_inputs: float = 0.0,
    op_sac_saved: float = 0.0,
) -> float:
    """Saved activations of one layer for one micro-batch of `seq` tokens (a context-parallel rank's share
    of the sequence under cp) (Korthikanti et al. 2022, generalised).

    With the fused kernels a norm saves its input and a gated MLP its gate and up projections; the PyTorch
    reference ops (fused_kernels false) also save RMSNorm's normalised input (x * rstd, for the weight's
    gradient) and silu/gelu(gate) (for the product's gradient): one more h and f per token. Ring attention
    (context parallelism) also keeps its output in fp32 and the fp32 log-sum-exp of every row. A MoE model's
    layer is the larger of its dense and its MoE layers (moe_mlp_saved_per_token). float8_inputs: the dense
    linears' inputs (QKV, MLP, out-projection and down-projection inputs) are saved in float8, a byte each
    (Transformer Engine's FP8 linears, Software.te_fp8). gathered_inputs: under SP the QKV and MLP inputs
    are kept whole, as their region all-gathered them, this many bytes an element (Software.
    tp_saves_gathered_input: 1 where the gather is float8, float8_tp); 0: kept as the sequence shard.
    Under torchtitan's op-level selective recomputation (selective_op) a layer keeps its input (the
    checkpoint's), the outputs of the linears its policy saves (`op_sac_saved` elements a token on the rank:
    CostBase.op_sac_linears) and attention's output with its fp32 log-sum-exp.
    """
    m, e, s = model, act_bytes, seq
    h, d = m.hidden_size, m.head_size
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (tp if sp else 1)  # the layer's input only
    if recompute == "selective_op":
        attention = (m.num_attention_heads * d * e + 4 * m.num_attention_heads) / tp
        return e * sbh / (tp if sp else 1) + s * b * (attention + e * op_sac_saved)
    a, kv, f = m.num_attention_heads, m.kv_heads, m.ffn_size
    kv_local = max(kv / tp, 1) * tp  # kv heads are replicated when tp exceeds them
    hidden_mask = 1 if m.hidden_dropout > 0 else 0
    # Replicated over TP unless SP: 2 norm inputs, QKV input, MLP input, 2 dropout masks.
    unfused_norms = 2 if not fused_kernels and m.arch != "gpt" else 0  # LayerNorm saves no extra copy
    lin = 1 if float8_inputs else e  # bytes of a saved linear input
    whole = 2 * gathered_inputs * sbh if sp and gathered_inputs else 0.0
    replicated = ((2 + unfused_norms) * e + (0 if whole else 2 * lin) + hidden_mask * 2) * sbh
    # Split over TP: Q, K, V, attention output (out-proj input), MLP intermediates.
    # gated: gate+up output and the product (down-projection input); unfused also the activated gate
    mlp = ((2 if fused_kernels else 3) * e + lin) * f if F.is_gated(m) else (e + lin) * f
    if m.is_moe:
        mlp = max(mlp, moe_mlp_saved_per_token(m, e, fused_kernels, moe_imbalance))
    ring = (4 * a * d + 4 * a) if ring_attention else 0
    split = s * b * ((a + 2 * kv_local) * d * e + a * d * lin + mlp + ring)
    if not flash_attention and recompute != "selective":
        drop = m.attention_dropout > 0
        split += a * s * s * b * (e + (1 + e if drop else 0))  # softmax output (+ dropout mask and output)
    return replicated / (tp if sp else 1) + split / tp + whole


def moe_mlp_saved_per_token(
    model: ModelConfig, act_bytes: int, fused_kernels: bool, imbalance: float
) -> float:
    """Bytes a MoE layer's MLP saves per token of the rank (before the TP split): the router's fp32 logits
    and probabilities, then per routed row (top-k per token, times the load `imbalance` of the busiest rank)
    the dispatched input, the expert's output cast to fp32 (kept by the routing weight's product,
    llmtrain.models.moe.Experts) and the gated MLP's intermediates (gate+up output and the product on both
    kernel paths: kernels.moe_experts keeps no activated gate), and the shared experts' intermediates per
    token."""
    m, e = model, act_bytes
    f = m.expert_ffn_size
    routed = m.num_experts_per_tok * imbalance * ((e + 4) * m.hidden_size + 3 * f * e)
    return 2 * 4 * m.num_experts + routed + m.num_shared_experts * (3 if fused_kernels else 4) * f * e


def layer_parameters(
    model: ModelConfig, tp: int, ep: int, counts: F.ParamCounts | None = None
) -> tuple[float, float]:
    """(replicated, routed-expert) parameters of the mean layer on one TP rank: a MoE model's routers and
    shared experts are averaged over its layers with the replicated part, whole on every TP rank (the
    trainer splits the sequence over TP for them, not their weights), as are latent attention's
    down-projections and the QK-norms (flops.attention_whole_parameters); its routed experts are divided
    over the ep ranks only. `counts`: the model's parameter counts, if known."""
    counts = counts or F.parameter_counts(model)
    experts = F.expert_parameters(model)
    whole = F.moe_whole_parameters(model) + F.attention_whole_parameters(model) * model.num_layers
    split = counts.per_layer * model.num_layers + counts.moe_extra - experts - whole
    return (split / tp + whole) / model.num_layers, experts / model.num_layers / ep


def stage_layers(model: ModelConfig, num_stages: int, balance: bool) -> tuple[int, ...]:
    """Layers per pipeline stage as the trainer splits them (llmtrain.pipeline.partition): even, or with
    `balance` by FLOPs with the output layer counted on the last stage, which moves layers forward."""
    head_cost = F.head_cost_in_layers(model) if balance and num_stages > 1 else 0.0
    return _stage_layers(model.num_layers, num_stages, head_cost)


@functools.lru_cache(maxsize=1024)
def _stage_layers(num_layers: int, num_stages: int, head_cost: float) -> tuple[int, ...]:
    # Cached: the search asks again for every layout with the same pipeline depth.
    return tuple(len(r) for r in partition_layers(num_layers, num_stages, head_cost=head_cost))


def pending_weight_grads(schedule: str, pp: int, num_micro: int, rank: int, v: int = 1) -> float:
    """Micro-batches (through all of a rank's chunks) whose weight gradient (W) a rank still owes when it
    computes an input gradient (I): zb_h1 defers rank r's W by r micro-batches to fill the bubble (replayed
    from its generator: 0 on the first rank, 1 on the second, ..., at most m - 1); zb_v, dualpipe_v and
    interleaved_zb owe what their action lists say (the peak of (micro-batch, chunk) pairs between I and W,
    over v); the other schedules run the whole backward at once."""
    if schedule in REPLAYED and pp > 1:
        return replayed_peaks(schedule, pp, num_micro, v)[1][rank] / v
    return min(rank, num_micro - 1) if schedule == "zb_h1" else 0


def weight_grad_inputs_per_layer(model: ModelConfig, tokens: int, act_bytes: int, tp: int) -> float:
    """What one layer keeps for a deferred weight gradient: each linear's input and output gradient (the
    recomputed inputs under full recompute; the inputs are the activations already counted otherwise, but
    the input gradient has freed the rest of the micro-batch's activations)."""
    m = model
    h, d, f = m.hidden_size, m.head_size, m.ffn_size
    qkv = (m.num_attention_heads + 2 * max(m.kv_heads / tp, 1) * tp) * d
    up = (2 if F.is_gated(m) else 1) * f
    outputs = (qkv + h + up + h) / tp  # q/k/v, out-projection, gate/up, down
    inputs = 2 * h + (m.num_attention_heads * d + f) / tp
    return tokens * act_bytes * (outputs + inputs)


def p2p_transfers_held(layout: Layout, num_micro: int, rank: int) -> int:
    """Activation-sized transfers pipeline rank `rank` still holds at its last peak when every micro-batch's
    are kept until the step's end (Software.p2p_held_until_step_end): per micro-batch an input received and
    its gradient sent back for each chunk but the first stage's, an output sent on for each but the last
    stage's; kept by the micro-batches done by then (all but those the schedule has in flight)."""
    pp, v = layout.pp, layout.virtual_stages
    per_micro = 2 * (v - (rank == 0)) + v - (rank == pp - 1)
    in_flight = -(-peak_inflight_closed(layout.schedule, pp, num_micro, v, rank=rank) // v)
    return max(num_micro - in_flight, 0) * per_micro


def doubled_shard(model: ModelConfig, tp: int, group: int) -> float:
    """Elements of the shard FSDP2's to_empty holds twice while materialising: the largest shard of a tied
    weight or of a tensor whose first dimension (per TP rank) does not divide over `group`; 0 if none."""
    h, d, v = model.hidden_size, model.head_size, model.vocab_size
    q, kv = model.num_attention_heads * d, model.kv_heads * d
    up = 2 * model.ffn_size if F.is_gated(model) else model.ffn_size
    # (first dimension on a TP rank, elements of the rank's whole tensor): column-parallel weights split
    # their rows, row-parallel ones (o_proj, down_proj) their columns; KV heads replicate below one per rank.
    kv_rows = max(kv // tp, d)
    tensors = [
        (v // tp, v // tp * h),
        (q // tp, q // tp * h),
        (kv_rows, kv_rows * h),
        (h, h * q // tp),
        (up // tp, up // tp * h),
        (h, h * model.ffn_size // tp),
        (h, h),
    ]
    uneven = [numel for rows, numel in tensors if rows % group]
    if model.tied_embeddings:
        uneven.append(v // tp * h)
    return max(uneven, default=0) / group


def shard_group(layout: Layout) -> int:
    """Ranks the model state is sharded over: 1 at zero 0, else dp x cp, or dp_shard x cp under hybrid
    sharding (context parallel ranks hold the same parameters as data-parallel ones, so they share the
    shards: llmtrain.parallel.topology, llmtrain.parallel.fsdp)."""
    if layout.zero_stage == 0:
        return 1
    return (layout.dp_shard or layout.dp) * layout.cp


def edges_vocab_sharded(layout: Layout, model: ModelConfig) -> bool:
    """Whether the trainer runs `layout`'s embedding and output layer vocabulary-parallel over the ZeRO shard
    group (llmtrain.parallel.vocab_sharded; not under the DeepSpeed engine that offload selects)."""
    return layout.offload == "none" and vocab_sharded_edges(
        layout.zero_stage,
        layout.tp,
        layout.pp,
        layout.cp,
        layout.dp,
        layout.dp_shard,
        model.vocab_size,
        model.tied_embeddings,
    )


def expert_dp_size(layout: Layout) -> int:
    """Ranks holding the same routed experts (the expert-data-parallel group, llmtrain.parallel.topology):
    the tp x cp x dp ranks of a stage over ep (every TP rank holds its experts whole)."""
    return max(layout.tp * layout.cp * layout.dp // layout.ep, 1)


def expert_shard_group(layout: Layout) -> int:
    """Ranks the routed experts' state is sharded over from zero 1 on: their expert-data-parallel group
    (ZeRO-1's expert shards and FSDP2's expert mesh, llmtrain.parallel.fsdp); 1 at zero 0."""
    return 1 if layout.zero_stage == 0 else expert_dp_size(layout)


def sharding_problem(layout: Layout) -> str:
    """Why a layout's zero stage, hybrid sharding and offload do not go together (empty if they do)."""
    z, shard, offload = layout.zero_stage, layout.dp_shard, layout.offload
    if z not in (0, 1, 2, 3):
        return f"zero_stage must be 0, 1, 2 or 3; got {z}"
    if offload not in OFFLOADS:
        return f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}"
    if z and layout.dp == 1:
        return "ZeRO needs dp > 1"
    if shard is not None:
        if z < 2:
            return "hybrid sharding (dp_shard) shards parameters or gradients: needs zero_stage 2 or 3"
        if shard < 2 or layout.dp % shard or shard == layout.dp:
            return f"dp_shard={shard} must divide dp={layout.dp} and lie strictly between 1 and dp"
    if layout.grad_reduce not in get_args(GradReduce):
        return f"grad_reduce must be one of {', '.join(get_args(GradReduce))}; got {layout.grad_reduce!r}"
    if layout.grad_reduce == "step" and not layout.fsdp:
        return "grad_reduce=step chooses how FSDP2 accumulates: needs zero_stage 2 or 3 without offload"
    if offload != "none" and z < 2:
        return f"offload={offload} runs through a ZeRO-2/3 engine: needs zero_stage 2 or 3"
    if offload == "optimizer+params" and z != 3:
        return "offloading parameters needs zero_stage 3 (only sharded parameters can live on the host)"
    if offload != "none" and (layout.tp > 1 or layout.pp > 1 or shard is not None):
        return (
            f"offload={offload} runs through the DeepSpeed engine, which shards over data parallelism only: "
            "needs tp=1, pp=1 and no dp_shard"
        )
    return ""


def state_bytes(
    params: float, layout: Layout, precision: str, grad_bytes: int, shard: int | None = None
) -> dict[str, float]:
    """Device bytes of parameters, gradients and optimizer state of `params` parameters sharded over
    `shard` ranks (default shard_group), and the host bytes offload moves off the device (see the module
    docstring's table)."""
    e = 4 if precision == "fp32" else 2
    master = 0 if precision == "fp32" else 4
    n, z = shard or shard_group(layout), layout.zero_stage
    if z <= 1:
        rows = {"params": e * params, "grads": grad_bytes * params, "optimizer": (8 + master) * params / n}
    elif z == 2:
        rows = {"params": e * params, "grads": grad_bytes * params / n, "optimizer": 12 * params / n}
    else:
        rows = {"params": 4 * params / n, "grads": grad_bytes * params / n, "optimizer": 8 * params / n}
    host = 0.0
    moved = {
        "none": (),
        "optimizer": ("optimizer", "grads"),
        "optimizer+params": ("optimizer", "grads", "params"),
    }
    for row in moved[layout.offload]:
        host += rows[row]
        rows[row] = 0.0
    rows["host"] = host
    return rows


def rank_memory(
    model: ModelConfig,
    precision: str,
    layout: Layout,
    software: Software,
    *,
    inflight: int,
    num_micro: int,
    reserved_bytes: float,
    bucket_bytes: float = 25 * 2**20,
    counts: F.ParamCounts | None = None,
    optimizer: str = "adamw",
    float8_layer: float = 0.0,
    gathered_inputs: float = 0.0,
    op_sac_saved: float = 0.0,
) -> MemoryBreakdown:
    """Bytes on the fullest rank of `layout` (the first pipeline rank, or the last when its output layer and
    logits dominate; any rank under the layout's own stage split or per-layer recomputation), with the
    highest startup peak of them; `inflight` is the schedule's peak of
    micro-batches in flight on the first rank; `bucket_bytes` the data-parallel bucket (parallel.dp_bucket_mb,
    counted in fp32 bytes); `counts` the model's parameter counts (given: not counted again); `optimizer`
    train.optimizer (muon: see the module docstring); `float8_layer` the mean layer's weight elements
    gathered in float8, 1 byte each (train.fp8_all_gather); `gathered_inputs` the bytes an element of the
    QKV and MLP inputs kept whole under SP, `op_sac_saved` the elements a token of the linear outputs
    torchtitan's op-level selective recomputation saves (activation_bytes_per_layer)."""
    e = 4 if precision == "fp32" else 2
    counts = counts or F.parameter_counts(model)
    tp, pp, v, b = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batch
    s, h = model.seq_length // layout.cp, model.hidden_size  # a context-parallel rank's tokens
    # Rank r holds chunks r, r + pp, ...: the layout's own split, else the trainer's.
    stages = layout.stage_layers or stage_layers(model, pp * v, software.balance_stages)
    # One layer's parameters on a TP rank: the replicated part (a MoE model's routers and shared experts
    # averaged over its layers) and the routed experts apart, also divided over the ep ranks (their state
    # shards over the expert-data-parallel group: expert_shard_group).
    layer_p, layer_x = layer_parameters(model, tp, layout.ep, counts)
    modes = layout.layer_modes(model.num_layers)
    # One layer's saved activations under each recompute mode, the rest of the arguments the layout's.
    layer_bytes = functools.partial(
        activation_bytes_per_layer,
        model,
        s,
        e,
        software.flash_attention,
        tp,
        b,
        layout.sequence_parallel,
        fused_kernels=software.fused_kernels,
        ring_attention=layout.cp > 1 and layout.cp_comm == "ring" and not software.fused_ring_attention,
        moe_imbalance=software.moe_imbalance,
        float8_inputs=precision == "fp8" and software.te_fp8,
        gathered_inputs=gathered_inputs,
        op_sac_saved=op_sac_saved,
    )
    per_mode = {mode: layer_bytes(mode) for mode in dict.fromkeys(modes)}
    if layout.layer_recompute:
        acc = list(itertools.accumulate((per_mode[m] for m in modes), initial=0.0))
        ends = list(itertools.accumulate(stages, initial=0))
        chunk_act = [acc[ends[i + 1]] - acc[ends[i]] for i in range(len(stages))]
    else:
        chunk_act = [n * per_mode[layout.recompute] for n in stages]
    tok = b * s
    sp_div = tp if layout.sequence_parallel else 1
    # The first block's activations during its own backward (recomputed whole under full recomputation).
    first_block_end = layer_bytes("none" if modes[0] == "full" else modes[0])
    # Last rank: the micro-batches its schedule keeps in flight plus one micro-batch's logits at the start of
    # its backward. Fused cross-entropy: the logits and an fp32 copy. PyTorch's: the fp32 log-probabilities
    # it saves, their gradient and the fp32 logits' gradient (16-bit logits are cast up and not kept), and
    # under pipelining the logits themselves, the last stage's output, held until its backward.
    per_logit = (e + 4) if software.fused_kernels else 12 + (e if pp > 1 else 0)
    logits = tok * model.vocab_size / tp * per_logit
    # zb_h1's deferred weight gradients: per owed micro-batch, its layers' linear inputs and output
    # gradients and, on the last stage, the output layer's: the logits' gradient and the final hidden state.
    wgrad = weight_grad_inputs_per_layer(model, tok, e, tp)

    # The embedding and output layer stay vocabulary-sharded here (llmtrain.parallel.vocab_sharded): never
    # gathered; the shard group's final hidden states are, kept for the backward, and this rank's logits are
    # its share of the group's, as many as its own would be.
    vocab_sharded = edges_vocab_sharded(layout, model)

    # The routed experts of the multi-token prediction blocks that are MoE ones (gated, as expert_parameters).
    moe_depths = sum(model.is_moe_layer(model.num_layers + k) for k in range(model.mtp_layers))
    mtp_routed = moe_depths * model.num_experts * 3 * h * model.expert_ffn_size

    def rank_parts(r: int) -> tuple[float, float, float, float, float]:
        """(replicated parameters, routed experts' parameters, activation bytes, pipeline transfers held
        until the step's end, the layers' replicated parameters) of pipeline rank r."""
        mine = layout.rank_stages(r)
        layers = [stages[s] for s in mine]
        first, last = r == layout.stage_rank(0), r == layout.stage_rank(pp * v - 1)
        # Multi-token prediction's modules on the last stage, split over TP as a layer is (eh_proj and their
        # norms, replicated, are a rounding error beside the block) and an MoE block's routed experts over ep
        # as a layer's are, and with pp an embedding copy to embed with, unless the tied head's copy serves.
        mtp = (counts.mtp - mtp_routed) / tp if last else 0.0
        if pp == 1:
            params = model.num_layers * layer_p + (counts.embedding + counts.head + counts.final_norm) / tp
        else:
            head = (counts.head or model.vocab_size * h) / tp  # tied: a copy on the last stage
            params = sum(layers) * layer_p
            params += (counts.embedding / tp if first else 0.0) + (head + counts.final_norm if last else 0.0)
            if mtp and counts.head and not first:
                mtp += counts.embedding / tp
        params += mtp
        held = inflight if first else peak_inflight_closed(layout.schedule, pp, num_micro, v, rank=r)
        owed = pending_weight_grads(layout.schedule, pp, num_micro, r, v)
        act = held * max(chunk_act[s] for s in mine) + owed * sum(layers) * wgrad
        if first:
            act += inflight * e * tok * h / sp_div  # the stage's input
        if last:
            # Each multi-token prediction depth keeps logits of its own for its backward.
            act += logits * (1 + model.mtp_layers) + owed * tok * (model.vocab_size / tp + h) * e
            act += layout.dp * e * tok * h if vocab_sharded else 0.0
        p2p = 0.0
        if pp > 1 and software.p2p_held_until_step_end:
            p2p = p2p_transfers_held(layout, num_micro, r) * e * tok * h / sp_div
        return (
            params,
            sum(layers) * layer_x + (mtp_routed / layout.ep if last else 0.0),
            act,
            p2p,
            sum(layers) * layer_p,
        )

    # Under the trainer's split the first (most in flight) or the last rank (output layer) is the fullest;
    # a split of the layout's own, or per-layer recomputation, may make any rank the fullest.
    explicit = layout.stage_layers or layout.layer_recompute
    ranks = range(pp) if explicit else sorted({0, pp - 1})

    # Pipeline sends and receives of one micro-batch's activation, and sequence parallelism's gathered layer
    # input. Data-parallel reductions work in place on the flat gradient buffer (NCCL), but the gloo
    # ZeRO-1 exchange receives dp - 1 peer copies of each bucket's shard, all alive until the step's end.
    buffers = (2 * e * tok * h / sp_div if pp > 1 else 0) + (e * tok * h if layout.sequence_parallel else 0)

    # The largest block gathered at once (per TP rank): a layer, the embedding or the output layer.
    largest = (
        layer_p + layer_x
        if vocab_sharded
        else max(layer_p + layer_x, max(counts.embedding, counts.head) / tp)
    )
    gathered = 0.0
    if layout.zero_stage == 3:
        # At the peak (the backward's start, in the output layer) the prefetched block is the last layer.
        prefetched = software.zero3_prefetch * counts.per_layer / tp
        gathered = e * (largest + prefetched) + software.grad_bytes * largest
        # train.fp8_all_gather: the gathered blocks' float8 linears' weights take 1 byte an element.
        blocks = software.zero3_prefetch + (largest == layer_p + layer_x)
        gathered -= (e - 1) * float8_layer * blocks
    elif layout.zero_stage == 2:
        gathered = software.grad_bytes * largest
    else:
        # The largest block's weight gradient as autograd produces it, alive until a hook adds it into the
        # flat main gradient (FSDP2's unsharded gradient above plays this part at zero 2/3).
        gathered = e * largest

    total_params = counts.total

    def one(dense: float, expert: float, activations: float, p2p_held: float, body: float) -> MemoryBreakdown:
        state = state_bytes(dense, layout, precision, software.grad_bytes)
        if expert:
            more = state_bytes(expert, layout, precision, software.grad_bytes, expert_shard_group(layout))
            state = {key: value + more[key] for key, value in state.items()}
        assembled = 0.0
        if optimizer == "muon":
            # One momentum buffer instead of two moments on the blocks' matrices; their whole fp32 copy.
            state["optimizer"] -= 4 * body / shard_group(layout) + 4 * expert / expert_shard_group(layout)
            assembled = 4 * (body * tp + expert * layout.ep)
        params = dense + expert
        if layout.fsdp:
            # FSDP2 at the peak, the backward's start: zero_grad dropped the step's gradient shards; with
            # accumulation the earlier micro-batches' gradients are in the shards (grad_reduce=microbatch)
            # or stay unsharded (grad_reduce=step: sync is off until the last micro-batch), a whole fp32
            # gradient of the rank's parameters.
            shards = state["grads"]
            if num_micro == 1:
                state["grads"] = 0.0
            elif layout.reduces_once_a_step:
                # Vocabulary-sharded edges are never gathered: their gradients reach the shards at once.
                edges = counts.embedding + counts.head if vocab_sharded else 0.0
                state["grads"] = software.grad_bytes * (params - edges) + shards * edges / params
            if num_micro == 1 and pp == 1 and shards + first_block_end > activations:
                # Or its end, in the first block's backward: every gradient shard is in by then (the first
                # block's own just after) and of the activations only that block's are left, recomputed
                # whole under full recomputation. The later peak when recomputation made the saved ones few.
                state["grads"], activations = shards, first_block_end
        exchange = 0.0
        if layout.offload != "none":
            # DeepSpeed's contiguous gradient bucket on the device, in the parameters' dtype (its elements:
            # the bucket's fp32 bytes / 4), allocated whole once the model outgrows it.
            exchange = e * min(bucket_bytes / 4, params)
        if software.gloo_shard_exchange and layout.zero_stage == 1:
            # The copies arrive as buckets complete and live until the step's end, when the backward has
            # freed the activations: they raise the peak only by what they exceed them.
            n = shard_group(layout)
            exchange = max(software.grad_bytes * params * (n - 1) / n - activations, 0.0)
        held = state["params"] + state["grads"]
        if e == 2 and layout.zero_stage <= 1:
            held += 4 * params  # exact fp32 initial values, kept until the optimizer copies its master
        if layout.offload != "none":
            # DeepSpeed is handed the model built whole in fp32; it flattens the parameters into one
            # contiguous copy while the modules still hold theirs, and creates the fp32 master and gradient
            # partitions (host memory here, but on a CPU the same memory; measured at zero 2 on CPU).
            startup = 4 * total_params + e * params + (4 + software.grad_bytes) * params / shard_group(layout)
        elif software.sharded_init and layout.zero_stage >= 2:
            # FSDP2 shards the meta model and the rank allocates only its fp32 shards; on top of them, one
            # initialisation block drawn whole where a shard cuts it (llmtrain.models.init.BLOCK_NUMEL
            # elements at most), and one shard FSDP2's to_empty briefly holds twice when a weight is tied
            # or a shard is padded (its first dimension does not divide over the shard group).
            group = shard_group(layout)
            startup = 4 * dense / group + 4 * expert / expert_shard_group(layout)
            startup += 4 * min(INIT_BLOCK_NUMEL, largest)
            startup += 4 * doubled_shard(model, tp, group)
        elif software.sharded_init:
            # The rank's own fp32 modules, materialised on it, alive while their values are copied into the
            # flat buffers.
            startup = 4 * params + held
        else:
            # First the whole model and, under TP, the rank's slice cut from it; then the rank's fp32
            # modules while their values are copied into the flat buffers.
            startup = max(4 * total_params + (4 * params if tp > 1 else 0), 4 * params + held)
        return MemoryBreakdown(
            params=state["params"],
            grads=state["grads"],
            optimizer=state["optimizer"],
            activations=activations,
            gathered=gathered,
            buffers=buffers + exchange + p2p_held + assembled,
            reserved=reserved_bytes,
            startup=startup + reserved_bytes,
            host=state["host"],
        )

    parts = [rank_parts(r) for r in ranks]
    if len(parts) > 2 and not (software.gloo_shard_exchange and layout.zero_stage == 1):
        # Steady state is linear in (parameters, activations) and startup grows with the parameters (the
        # gloo exchange, and offload's bucket at pp=1, are the exceptions): two ranks can be the fullest.
        unit = (
            state_bytes(1.0, layout, precision, software.grad_bytes, n)
            for n in (None, expert_shard_group(layout))
        )
        per_param, per_expert = (sum(v for k, v in rows.items() if k != "host") for rows in unit)
        steadiest = max(parts, key=lambda pa: per_param * pa[0] + per_expert * pa[1] + pa[2] + pa[3])
        parts = list(dict.fromkeys((steadiest, max(parts, key=lambda pa: pa[0] + pa[1]))))
    per_rank = [one(*pa) for pa in parts]
    fuller = max(per_rank, key=lambda m: m.steady)  # the first of equals: rank 0
    # The steady-state rows of the rank fullest in training; the startup peak of whichever rank's is higher.
    return replace(fuller, startup=max(m.startup for m in per_rank))
