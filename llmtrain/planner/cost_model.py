"""Analytical cost model: step time and memory per rank of one parallel layout on one cluster.

Per transformer layer and micro-batch (b samples of s tokens, on one tensor-parallel rank):
- compute: each projection is a matmul timed on the device's efficiency curve (cluster.Device.gemm_time:
  soft roofline plus kernel overhead, so small matmuls run at lower efficiency); the attention core is a fused
  (flash) kernel, or, without flash attention, two batched matmuls plus the s x s softmax/dropout traffic;
  norms, residual adds, activation functions and rotary embeddings are memory-bound kernels. Backward costs
  twice the forward's matmuls (input and weight gradients) and twice its memory traffic.
- tensor parallelism: per layer 2 all-reduces of b*s*h in the forward and 2 in the backward, or with sequence
  parallelism the same number of all-gathers plus reduce-scatters, on the link class the TP group spans;
  full recomputation repeats the forward's collectives in the backward.
- recomputation: full re-runs the layer's forward in the backward; selective re-runs the attention core.
- pipeline: per-chunk forward/backward costs (first stage adds the embedding, last the logits and loss) go
  through llmtrain.planner.pipeline_time (the pipeline simulator or its closed forms), with the activation
  send as the point-to-point cost.
- context parallelism (cp): each rank holds b*s/cp tokens, so projections, MLP and memory-bound kernels run on
  a cp-th of the tokens and the attention core on a cp-th of the score square (the two mirrored chunks
  balance the causal mask). ring: the attention runs as PyTorch block matmuls in fp32 (2cp+1 visible chunk
  pairs of (s/2cp)^2, recomputed in the backward), each step's fp32 K/V transfer overlapped with that step's
  blocks (exposed: max(0, transfer - compute) per step; the backward also carries dK/dV and sends them
  home); all_to_all: the fused kernel over the whole sequence for a/cp heads, and 4 all-to-alls (q, k, v,
  output) of the rank's activation in the forward and 4 in the backward, not overlapped. The gradients are
  reduced over dp x cp (collectives.cp_layer and tests/planner/test_collectives.py, traced).
- mixture of experts: routed experts' matmuls run on top-k rows per token (times Software.moe_imbalance, the
  busiest rank's load over the mean) spread over the E/ep experts of the rank, plus the router and shared
  experts; under TP each TP rank routes 1/tp of the tokens with the MoE weights whole (no MLP region, the
  router statistics all-reduced over TP and CP). Expert parallelism (ep ranks carved out of the tp x cp x dp
  ranks as the trainer carves them: inside dp, spanning cp or tp) adds a dispatch and a combine all-to-all
  of the rank's routed rows x hidden per MoE layer in the forward and again in the backward, on the links
  the ep group spans (collectives.expert_group_strides); routed experts' gradients are reduced over the
  expert-data-parallel group (tp x cp x dp / ep), under FSDP2 as units of their own on that group.
- latent attention (deepseek_v3): the up-projections and o_proj split by heads over TP, the down-projections
  and their norms whole on every rank (their gradients in the TP all-reduce of partial sums).
- data parallelism: gradient all-reduce (ZeRO-0) or reduce-scatter plus parameter all-gather (ZeRO-1) over
  the DP group, overlapped with the last micro-batch's backward when the framework overlaps it; then the
  optimizer step, memory-bound over the rank's (sharded) fp32 state.
Memory per rank: weights, gradients and optimizer state per precision and ZeRO stage; activations per layer
after Korthikanti et al. 2022 (generalised to GQA, gated MLPs and flash attention) times the layers of the
rank times the in-flight micro-batches of the schedule; communication buffers; the device's reserve.
Per-layer plans (Layout.layer_recompute, Layout.stage_layers: what llmtrain.planner.per_layer searches) sum
each rank's layers under their own recompute modes, so the busiest rank sets the pipeline's pace, and size
every rank's memory from its own chunks' activations under its schedule's in-flight micro-batches.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from llmtrain.config.schema import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from llmtrain.config.validate import (
    context_parallel_problem,
    expert_layout_problem,
    layer_plan_problem,
    moe_problem,
    pipeline_problem,
    tensor_parallel_problem,
)
from llmtrain.planner import collectives as C
from llmtrain.planner import flops as F
from llmtrain.planner import host_ops as H
from llmtrain.planner.cluster import ClusterView
from llmtrain.planner.memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    edges_vocab_sharded,
    expert_dp_size,
    expert_shard_group,
    layer_parameters,
    rank_memory,
    shard_group,
    sharding_problem,
    stage_layers,
)
from llmtrain.planner.pipeline_time import PipelineTime, pipeline_time

GIB = 2.0**30
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe")


@dataclass(frozen=True)
class Layout:
    """One parallel configuration (the fields of ParallelConfig / TrainConfig the planner chooses)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    zero_stage: int = 0
    dp_shard: int | None = None
    """Hybrid sharding (HSDP): DP ranks sharing a shard (and their CP ranks), replicas across; None = dp."""
    offload: str = "none"
    """CPU offload: none, optimizer (state and gradient shard) or optimizer+params (zero 3)."""
    layer_recompute: tuple[str, ...] | None = None
    """Recompute mode of each layer (model.recompute_layers), replacing `recompute`; None: uniform."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each model chunk (parallel.stage_layers, pp * virtual_stages); None: the trainer's split."""
    cp: int = 1
    """Context-parallel degree (each sequence split over cp ranks)."""
    cp_comm: str = "ring"
    """Context-parallel attention: ring or all_to_all."""
    ep: int = 1
    """Expert-parallel degree: the routed experts split over ep ranks carved out of the tp x cp x dp ranks
    (ep dividing dp, dp times a divisor of cp, or dp x cp times a divisor of tp: collectives.ep_placement)."""
    grad_reduce: str = "microbatch"
    """zero 2/3 without offload: gradients reduce-scattered after every micro-batch, or once a step."""

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 (llmtrain's engine) shards the model state: zero 2/3 without offload."""
        return self.zero_stage >= 2 and self.offload == "none"

    @property
    def reduces_once_a_step(self) -> bool:
        """FSDP2 accumulating unsharded gradients for one reduction a step (grad_reduce=step)."""
        return self.fsdp and self.grad_reduce == "step"

    def reductions(self, num_micro: int) -> int:
        """How many times a step of `num_micro` micro-batches reduces its gradients over data parallelism."""
        return num_micro if self.fsdp and not self.reduces_once_a_step else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def layer_modes(self, num_layers: int) -> tuple[str, ...]:
        """The recompute mode of every layer."""
        return self.layer_recompute or (self.recompute,) * num_layers

    def per_layer_short(self) -> str:
        """The per-layer choices in a few characters, run-length coded: recompute as layers x letter (f, s,
        n), e.g. rc=3f+5n; layers per chunk as chunks x layers, e.g. stages=2x5+1x6; empty for a uniform
        layout."""
        parts = []
        if self.layer_recompute:
            parts.append("rc=" + _runs(m[0] for m in self.layer_recompute))
        if self.stage_layers:
            parts.append("stages=" + _runs(self.stage_layers, "x"))
        return " ".join(parts)

    def short(self) -> str:
        """Compact one-line description."""
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        rc = "per-layer" if self.layer_recompute else self.recompute
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} mb={self.micro_batch} {sched} rc={rc} "
            f"sp={int(self.sequence_parallel)} zero={self.zero_stage}"
            + (f" shard={self.dp_shard}" if self.dp_shard else "")
            + (f" offload={self.offload}" if self.offload != "none" else "")
            + (f" cp={self.cp}({self.cp_comm})" if self.cp > 1 else "")
            + (f" ep={self.ep}" if self.ep > 1 else "")
            + (" reduce=step" if self.reduces_once_a_step else "")
            + (f" {self.per_layer_short()}" if self.layer_recompute or self.stage_layers else "")
        )


def _runs(items: Iterable[object], sep: str = "") -> str:
    """Consecutive equal items as count + sep + item, joined by '+': "aab" -> "2a+1b"."""
    return "+".join(f"{len(list(group))}{sep}{item}" for item, group in itertools.groupby(items))


@dataclass(frozen=True)
class Software:
    """What the training framework does (not the hardware): defaults describe llmtrain."""

    flash_attention: bool = True
    """Fused attention without the s x s score matrix in memory."""
    dp_overlap: bool = True
    """Gradient reduction overlaps the backward (bucketed)."""
    p2p_scatter_gather: bool = False
    """Pipeline sends split over the TP ranks (Megatron's scatter/gather); with SP the activations are split
    anyway."""
    grad_bytes: int = 4
    """Bytes per gradient element held and reduced (fp32 main gradients)."""
    fused_kernels: bool = True
    """The model's norms, SwiGLU/GeGLU, attention and cross-entropy run as llmtrain's fused Triton kernels
    (model.kernels auto on CUDA); false: the PyTorch reference ops (CPU), which save more for backward and
    move more bytes (host_ops.reference_bytes)."""
    gloo_shard_exchange: bool = False
    """ZeRO-1, and FSDP2 at ZeRO-2/3, reduce-scatter and all-gather by point-to-point exchange of the shards
    with each peer, into separate receive buffers (gloo, CPU) instead of NCCL's in-place collectives."""
    p2p_held_until_step_end: bool = False
    """Pipeline transfers of every micro-batch stay alive until the step's end (llmtrain's executor on gloo,
    measured: received activations, and the sent activations and gradients its pending sends hold)."""
    sharded_init: bool = True
    """Each rank builds only its own shards on the meta device; false: every rank first builds the whole model
    in fp32 and then slices it, which bounds the startup peak."""
    balance_stages: bool = True
    """Pipeline stages split by FLOPs with the output layer counted on the last (the trainer's default
    parallel.balance_stages); false: an even split."""
    overlap_param_gather: bool = True
    """ZeRO-1's parameter all-gather hides behind the next step's first forward (overlap_param_gather)."""
    zero3_prefetch: int = 1
    """Blocks gathered ahead of the one computing under ZeRO-3 (FSDP2's implicit prefetch: one)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the framework runs (the search considers these)."""
    hybrid_sharding: bool = True
    """The framework shards inside a group and replicates across groups (HSDP; the search tries one node)."""
    offload: bool = True
    """The framework offloads optimizer state (and ZeRO-3 parameters) to the host (llmtrain: through the
    DeepSpeed engine, which runs data parallelism only: tp=1, pp=1, no hybrid sharding)."""
    grad_accumulation_fusion: bool = False
    """The weight-gradient matmuls accumulate into the fp32 gradient buffer (Megatron-LM's
    gradient_accumulation_fusion); false: llmtrain, whose every micro-batch adds its gradients into the
    buffer in a separate memory-bound pass."""
    moe_imbalance: float = 1.0
    """Routed rows of the busiest expert-parallel rank over the mean: an assumption, 1.0 for dropless routing
    kept balanced by the load-balancing loss; it scales the experts' compute, activations and all-to-alls."""

    @classmethod
    def whole_model_init(cls) -> Software:
        """llmtrain before issue 15: every rank builds the whole model, ZeRO 0/1 only (what sharded
        construction and parameter sharding buy, compared)."""
        return cls(sharded_init=False, zero_stages=(0, 1), hybrid_sharding=False, offload=False)

    @classmethod
    def megatron_2021(cls) -> Software:
        """Megatron-LM as run in Narayanan et al. 2021: materialised softmax, non-overlapped fp16 gradient
        all-reduce, scatter/gather pipeline sends, gradient accumulation fused into the weight-gradient
        matmuls (Megatron-LM's gradient_accumulation_fusion; an assumption for the paper's runs), layers
        split evenly over stages, ZeRO 0/1 at most; each rank initialises only its own shards."""
        return cls(
            flash_attention=False,
            dp_overlap=False,
            overlap_param_gather=False,
            p2p_scatter_gather=True,
            grad_accumulation_fusion=True,
            grad_bytes=2,
            sharded_init=True,
            balance_stages=False,
            zero_stages=(0, 1),
            hybrid_sharding=False,
            offload=False,
        )


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, sequence length, global batch and precision."""

    model: ModelConfig
    global_batch: int
    precision: str = "bf16"
    dp_bucket_mb: float = 25.0

    @property
    def seq(self) -> int:
        return self.model.seq_length

    @classmethod
    def from_job(cls, job: JobConfig, global_batch: int | None = None) -> Workload:
        """The workload of a job config (global batch overridable)."""
        return cls(
            model=job.model,
            global_batch=global_batch or job.train.global_batch_size,
            precision=job.train.precision,
            dp_bucket_mb=job.parallel.dp_bucket_mb,
        )


@dataclass
class Estimate:
    """Predicted step time, its breakdown, and memory per rank of one layout."""

    layout: Layout
    step_time: float
    compute: float
    """Compute time of the busiest rank (matmuls and memory-bound kernels, recompute included)."""
    tp_comm: float
    """Tensor-parallel collectives on the busiest rank (not overlapped)."""
    pp_bubble: float
    """Pipeline fill/drain and exposed point-to-point transfers."""
    dp_comm: float
    """Data-parallel gradient (and ZeRO parameter) communication, total."""
    dp_exposed: float
    """The part of dp_comm not hidden behind the backward."""
    optimizer: float
    """Optimizer step (and offload transfers)."""
    bubble_fraction: float
    memory: dict[str, float]
    """Bytes on the fullest rank: params, grads, optimizer, activations, gathered, buffers, reserved, steady,
    startup, host (offloaded, not on the device) and total (the peak: max of steady and startup)."""
    capacity: float
    fits: bool
    why: str
    tflops_per_gpu: float
    """Executed FLOP/s per GPU in TFLOP/s, recomputation included (the convention of Narayanan et al.)."""
    mfu: float
    """Model FLOPs (no recomputation) per second over the GPUs' dense peak."""
    simulated: bool = False
    cp_comm: float = 0.0
    """Context-parallel communication on the busiest rank not hidden behind the attention (included in the
    step)."""
    ep_comm: float = 0.0
    """Expert-parallel dispatch and combine all-to-alls on the busiest rank (not overlapped)."""
    recompute: float = 0.0
    """The part of `compute` that re-runs forwards for activation recomputation (busiest rank)."""
    pp_p2p: float = 0.0
    """The part of `pp_bubble` that point-to-point transfers add (the rest is fill and drain)."""

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / GIB

    def as_dict(self) -> dict:
        """Flat JSON-ready record."""
        out = asdict(self.layout)
        out.update(
            step_time_s=self.step_time,
            tflops_per_gpu=self.tflops_per_gpu,
            mfu=self.mfu,
            memory_gb=self.memory_gb,
            fits=self.fits,
            why=self.why,
            bubble_fraction=self.bubble_fraction,
            compute_s=self.compute,
            tp_comm_s=self.tp_comm,
            pp_bubble_s=self.pp_bubble,
            dp_comm_s=self.dp_comm,
            dp_exposed_s=self.dp_exposed,
            optimizer_s=self.optimizer,
            cp_comm_s=self.cp_comm,
            ep_comm_s=self.ep_comm,
            recompute_s=self.recompute,
            pp_p2p_s=self.pp_p2p,
            memory_breakdown_gb={k: v / GIB for k, v in self.memory.items()},
            pipeline_timing="simulator" if self.simulated else "closed-form",
        )
        return out


@dataclass(frozen=True)
class _Pass:
    """Costs of one layer (or stage extra) for one micro-batch: forward / backward / weight-grad compute and
    the TP communication inside them, and the exposed context- and expert-parallel communication."""

    fwd: float
    bwd: float
    wgrad: float
    tp_fwd: float
    tp_bwd: float
    cp_fwd: float = 0.0
    cp_bwd: float = 0.0
    ep_fwd: float = 0.0
    ep_bwd: float = 0.0


class CostModel:
    """Evaluates layouts of one workload on one cluster view; per-layer costs are cached across layouts."""

    def __init__(self, workload: Workload, cluster: ClusterView, software: Software | None = None) -> None:
        self.w = workload
        self.c = cluster
        self.sw = software or Software()
        self.dev = cluster.device
        self.prec = workload.precision
        self.act_bytes = 4 if self.prec == "fp32" else 2
        self.params = F.parameter_counts(workload.model)
        self._flops = {
            rc: F.training_flops_per_token(workload.model, workload.seq, rc) for rc in F.RECOMPUTE_MODES
        }
        self._model_flops = F.model_flops_per_token(workload.model, workload.seq)
        self._layer = functools.lru_cache(maxsize=None)(self._layer_costs)
        self._extras = functools.lru_cache(maxsize=None)(self._stage_extras)
        self._config_problem = functools.lru_cache(maxsize=None)(self._trainer_problem)

    # ------------------------------------------------------------------------------------ compute

    def _layer_costs(
        self,
        tp: int,
        b: int,
        sp: bool,
        recompute: str,
        cp: int = 1,
        cp_comm: str = "ring",
        ep: int = 1,
        dp: int = 1,
    ) -> _Pass:
        """One mean layer's _Pass for a micro-batch of `b` sequences; `dp` places the EP group (ep > 1)."""
        m, dev, prec = self.w.model, self.dev, self.prec
        s, h, d = self.w.seq, m.hidden_size, m.head_size
        a, kv = m.num_attention_heads / tp, max(m.kv_heads / tp, 1)
        tok = b * s // cp  # this context-parallel rank's tokens
        mlp_gemms, mlp_bytes = self._mlp_costs(tp, tok, ep)
        if m.arch == "deepseek_v3":
            # Latent attention: the query and key/value down- and up-projections, as many multiply-adds per
            # token as their weights (flops.latent_projection_params), the up-projections split by heads over
            # TP, the down-projections whole on every rank; scores over qk_nope + qk_rope wide heads, values
            # v_head_dim wide.
            down = F.latent_down_projection_params(m)
            attn = dev.gemm_time(tok, (F.latent_projection_params(m) - down) / (tp * h), h, prec)
            attn += dev.gemm_time(tok, down / h, h, prec)
            attn += dev.gemm_time(tok, h, a * m.v_head_dim, prec)
            width = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
        else:
            attn = dev.gemm_time(tok, (a + 2 * kv) * d, h, prec) + dev.gemm_time(tok, h, a * d, prec)
            width = d
        gemms = attn + mlp_gemms
        # Weight-gradient matmuls have the same sizes as the forward's (dW = X^T dY).
        wgrad = gemms
        e = self.act_bytes
        ring = cp > 1 and cp_comm == "ring"
        if ring:
            core_f, core_b = self._ring_core(tp, b, cp)
        elif self.sw.flash_attention or cp > 1:
            # The rank's queries against all keys (all_to_all: all tokens of a/cp heads): a cp-th of it.
            core_flops = 4.0 * tok * s * a * width
            core_f = dev.attention_time(core_flops, prec)
            core_b = 2.5 * dev.attention_time(core_flops, prec)  # flash backward recomputes QK^T: 5 matmuls
        else:
            scores = b * a * s * s
            # Fused scale-mask-softmax reads and writes the scores once; dropout adds a read, write and mask.
            softmax = scores * (2 * e + (2 * e + 1 if m.attention_dropout > 0 else 0))
            core_f = dev.gemm_time(s, s, d, prec, batch=b * a) + dev.gemm_time(s, d, s, prec, batch=b * a)
            core_f += dev.memory_time(softmax, kernels=2)
            core_b = 2 * core_f
        # Memory-bound kernels: 2 norms, 2 residual adds (+ dropout), the activation function, rotary.
        nh = tok * h / (tp if sp else 1)
        dropout = 1 if m.hidden_dropout > 0 else 0
        rotary = 0 if m.arch == "gpt" else 2 * e * tok * (a + kv) * d
        if self.sw.fused_kernels:
            elem = dev.memory_time(
                2 * 2 * e * nh + 2 * (3 * e + dropout) * nh + mlp_bytes + rotary, kernels=6
            )
            elem_b = 2 * elem
        else:  # PyTorch's ops (the CPU): more passes, as host_ops counts them (a dense layer's)
            ref_f, ref_b = H.reference_bytes(m, tok, tp, sp, e)
            # At the rate measured for the reference block at this many hidden-state bytes (a CPU's falls
            # from cache-sized activations to larger ones), where calibrated.
            elem = dev.memory_time(ref_f, kernels=6, tensor_bytes=e * nh)
            elem_b = dev.memory_time(ref_b, kernels=12, tensor_bytes=e * nh)
        fwd = gemms + core_f + elem
        bwd = 2 * gemms + core_b + elem_b
        if recompute == "full":
            bwd += fwd
        elif recompute == "selective":
            bwd += core_f
        # Tensor-parallel collectives on the b*s*h activation, as the trainer issues them (collectives.py),
        # the dense and the MoE layers' averaged; a MoE layer's router statistics summed over TP and CP.
        latent, share = m.arch == "deepseek_v3", F.moe_layer_count(m) / m.num_layers
        comms = C.tp_layer(tp, e * tok * h, sp, recompute, latent=latent)
        moe = C.tp_layer(tp, e * tok * h, sp, recompute, True, latent)
        stats = C.router_stats(m.num_experts, tp, cp, recompute)
        tp_f = (1 - share) * self._comm_time(comms.fwd) + share * self._comm_time(moe.fwd)
        tp_b = (1 - share) * self._comm_time(comms.bwd) + share * self._comm_time(moe.bwd)
        tp_f += share * self._router_stats_time(stats.fwd, "tp", tp)
        tp_b += share * self._router_stats_time(stats.bwd, "tp", tp)
        ops_f, ops_b = H.layer_ops(m, comms, recompute)
        fwd, bwd = self._with_host(fwd, ops_f), self._with_host(bwd, ops_b)
        cp_f, cp_b = self._cp_exposed(tp, tok, cp, cp_comm, recompute, core_f, core_b)
        cp_f += share * self._router_stats_time(stats.fwd, "cp", tp)
        cp_b += share * self._router_stats_time(stats.bwd, "cp", tp)
        ep_f = ep_b = self._ep_time(tp, tok, cp, ep, dp)
        return _Pass(fwd, bwd, wgrad, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b)

    def _router_stats_time(self, comms: tuple[C.Comm, ...], dim: str, tp: int) -> float:
        """Seconds of the router-statistics all-reduces (collectives.router_stats) over `dim` ("tp": adjacent
        ranks; "cp": ranks tp apart)."""
        stride = 1 if dim == "tp" else tp
        return sum(self.c.all_reduce(c.nbytes, c.size, stride) for c in comms if c.group == dim)

    def _with_host(self, device: float, ops: int) -> float:
        """Seconds of a pass of `device` seconds of compute that dispatches `ops` operators (host_ops).

        On a CPU the host is the device: each operator's dispatch runs on the cores between the kernels, so
        the two add. On an accelerator the host queues kernels while earlier ones run: the pass takes the
        longer of the two, so the host shows only when kernels are too small to cover their own dispatch
        (the large matmuls of a GPU cluster's layers hide it entirely). memory_time's per-kernel overhead
        already covers the few kernels it times: an overlap of a handful of the operators counted here."""
        host = ops * self.dev.host_op_us * 1e-6
        return device + host if self.dev.host_is_device else max(device, host)

    def _mlp_costs(self, tp: int, tok: int, ep: int) -> tuple[float, float]:
        """(matmul seconds, bytes of its memory-bound kernels) of the mean layer's MLP on `tok` tokens of a
        TP rank. A MoE layer (llmtrain.models.moe.Experts), its weights whole on the 1/tp of the tokens the
        TP rank routes (collectives.routed_rows): the router, then one expert after another, each on its
        share of the top-k rows per token (times Software.moe_imbalance) of the rank's E/ep experts, the
        shared experts, and the copies of every routed row (gathered by token, concatenated, weighted in
        fp32 and added back); a MoE model's dense and MoE layers are averaged."""
        m, dev, prec, e = self.w.model, self.dev, self.prec, self.act_bytes
        h, f = m.hidden_size, m.ffn_size / tp
        gated = F.is_gated(m)
        dense = dev.gemm_time(tok, (2 if gated else 1) * f, h, prec) + dev.gemm_time(tok, h, f, prec)
        dense_bytes = (6 if gated else 4) * e * tok * f
        moe_layers = F.moe_layer_count(m)
        if not moe_layers:
            return dense, dense_bytes
        fe, local, routing = m.expert_ffn_size, m.num_experts // ep, tok // tp
        rows = C.routed_rows(tok, m.num_experts_per_tok, tp) * self.sw.moe_imbalance
        per_expert = rows / local
        routed = local * (dev.gemm_time(per_expert, 2 * fe, h, prec) + dev.gemm_time(per_expert, h, fe, prec))
        shared_f = fe * m.num_shared_experts
        shared = 0.0
        if shared_f:
            shared = dev.gemm_time(routing, 2 * shared_f, h, prec) + dev.gemm_time(routing, h, shared_f, prec)
        moe = dev.gemm_time(routing, m.num_experts, h, prec) + routed + shared
        # Per routed row of h: gather (read, write), concatenate (read, write), cast up (read e, write 4),
        # weight (read 4, write 4), cast down (read 4, write e), index-add (read, write).
        moe_bytes = 6 * e * (rows * fe + routing * shared_f) + (8 * e + 16) * rows * h
        share = moe_layers / m.num_layers
        return (1 - share) * dense + share * moe, (1 - share) * dense_bytes + share * moe_bytes

    def _ring_core(self, tp: int, b: int, cp: int) -> tuple[float, float]:
        """(forward, backward) seconds of ring attention's blocks on one rank: 2cp+1 visible pairs of chunks
        of s/2cp tokens (the diagonal ones computed whole, then masked), each two batched matmuls and the
        fp32 softmax passes over its scores (write, log-sum-exp, exp, merge); the backward recomputes the
        scores and runs 4 more matmuls (dV, dP, dQ, dK) and the softmax's gradient. PyTorch computes them in
        fp32 (llmtrain.parallel.context_parallel), not in a fused kernel."""
        m, dev = self.w.model, self.dev
        c, d, heads = self.w.seq / (2 * cp), m.head_size, b * m.num_attention_heads / tp
        pairs = 2 * cp + 1
        scores = 4.0 * heads * c * c
        qk = dev.gemm_time(c, c, d, "fp32", batch=heads)
        pv = dev.gemm_time(c, d, c, "fp32", batch=heads)
        fwd = pairs * (qk + pv + dev.memory_time(4 * scores, kernels=4))
        bwd = pairs * (2 * qk + 3 * pv + dev.memory_time(6 * scores, kernels=5))
        return fwd, bwd

    def _cp_exposed(
        self, tp: int, tok: int, cp: int, cp_comm: str, recompute: str, core_f: float, core_b: float
    ) -> tuple[float, float]:
        """Context-parallel communication of one layer not hidden behind compute, (forward, backward).

        ring: every step's transfer runs while the step's blocks are computed (core / cp each): the forward's
        cp - 1 steps send one K/V block, the backward's first and last step one block, the cp - 2 between
        two (K/V and dK/dV), then dK/dV go home with nothing left to overlap. all_to_all: its collectives
        (collectives.cp_layer) are waited for. Recomputation repeats the forward's."""
        if cp == 1:
            return 0.0, 0.0
        m = self.w.model
        comms = C.cp_layer(
            cp, cp_comm, tok, m.num_attention_heads // tp, max(m.kv_heads // tp, 1), m.head_size,
            self.act_bytes, recompute,
        )  # fmt: skip
        if cp_comm != "ring":
            fwd = sum(self.c.all_to_all(c.nbytes, cp, tp) for c in comms.fwd)
            return fwd, sum(self.c.all_to_all(c.nbytes, cp, tp) for c in comms.bwd)
        t = self.c.p2p(comms.fwd[0].nbytes, self.c.spans_nodes(cp, tp))
        step_f, step_b = core_f / cp, core_b / cp
        fwd = (cp - 1) * max(0.0, t - step_f)
        bwd = 2 * max(0.0, t - step_b) + (cp - 2) * max(0.0, 2 * t - step_b) + t
        return fwd, bwd + (fwd if recompute != "none" else 0.0)

    def _ep_time(self, tp: int, tok: int, cp: int, ep: int, dp: int) -> float:
        """Seconds of the mean layer's expert-parallel all-to-alls in one pass (forward or backward): a
        dispatch and a combine of the rank's routed rows (collectives.routed_rows, times the imbalance) of h
        elements, over the ep group (where _expert_strides places it), in the MoE layers."""
        m = self.w.model
        moe_layers = F.moe_layer_count(m)
        if ep == 1 or not moe_layers:
            return 0.0
        rows = C.routed_rows(tok, m.num_experts_per_tok, tp) * self.sw.moe_imbalance
        stride = self._expert_strides(Layout(tp=tp, cp=cp, dp=dp, ep=ep))[0]
        once = self.c.all_to_all(self.act_bytes * rows * m.hidden_size, ep, stride)
        return 2 * once * moe_layers / m.num_layers

    def _expert_strides(self, layout: Layout) -> tuple[int, int]:
        """The EP and expert-DP groups' strides on this cluster (collectives.expert_group_strides)."""
        return C.expert_group_strides(layout.tp, layout.cp, layout.dp, layout.ep, self.c.devices_per_node)

    def _stage_extras(self, tp: int, b: int, sp: bool, cp: int = 1, vocab_dp: int = 1) -> tuple[_Pass, _Pass]:
        """(first stage: embedding, last stage: final norm, logits and cross-entropy) per micro-batch;
        `vocab_dp` > 1: the edges vocabulary-sharded over that many ZeRO ranks (the same FLOPs per rank, the
        group's tokens against its share of the vocabulary, plus collectives.vocab_sharded_edges)."""
        m, dev, prec, e = self.w.model, self.dev, self.prec, self.act_bytes
        tok, h, vocab = b * self.w.seq // cp, m.hidden_size, m.vocab_size / tp
        size = e * tok * h
        # Device.memory_table times the reference path's operators: the fused kernels (a GPU's) keep the
        # bandwidth model, whose terms are a few percent of a GPU layer's time.
        measured = 0.0 if self.sw.fused_kernels else 1.0
        emb_f = dev.memory_time(2 * e * tok * h, kernels=2, tensor_bytes=measured * size)
        emb, head = C.edge_layers(tp, sp, vocab_dp, size, tok)
        first = _Pass(emb_f, 2 * emb_f, emb_f, self._comm_time(emb.fwd), self._comm_time(emb.bwd))
        # The logits are the one output large enough to come fresh from the system on a CPU (the gradient
        # ones the cross-entropy writes are in its measured rate); a GPU's allocator reuses its blocks.
        logits = dev.gemm_time(tok, vocab, h, prec)
        logits_f = logits + dev.fresh_time(e * tok * vocab)
        # The fp32 softmax, loss and its gradient, in passes over the rank's logits (host_ops.CE_PASSES).
        ce_bytes = 4 * tok * vocab
        passes = H.ce_passes(self.sw.fused_kernels, tp > 1 or vocab_dp > 1)
        ce_f, ce_b = (
            dev.memory_time(n * ce_bytes, kernels=n, tensor_bytes=measured * ce_bytes, kind="softmax")
            for n in passes
        )
        hidden = size / (tp if sp else 1)
        norm = dev.memory_time(2 * hidden, tensor_bytes=measured * hidden)
        head_tp, head_tp_b = self._comm_time(head.fwd), self._comm_time(head.bwd)
        # The embedding's few operators are counted with the head's (host_ops.extra_ops).
        ops_f, ops_b = H.extra_ops(m)
        last_f = self._with_host(logits_f + ce_f + norm, ops_f)
        last_b = self._with_host(2 * logits + ce_b + 2 * norm, ops_b)
        last = _Pass(last_f, last_b, logits, head_tp, head_tp_b)
        return first, last

    def _comm_time(self, comms: tuple[C.Comm, ...]) -> float:
        """Seconds for TP collectives issued one after another (the group's ranks are adjacent: stride 1)."""
        cost = {"all_reduce": self.c.all_reduce, "all_gather": self.c.all_gather}
        return sum(cost.get(c.op, self.c.reduce_scatter)(c.nbytes, c.size) for c in comms)

    # ------------------------------------------------------------------------------------ memory

    def activation_bytes_per_layer(self, tp: int, b: int, sp: bool, recompute: str) -> float:
        """Saved activations of one layer for one micro-batch (llmtrain.planner.memory)."""
        return activation_bytes_per_layer(
            self.w.model, self.w.seq, self.act_bytes, self.sw.flash_attention, tp, b, sp, recompute,
            self.sw.fused_kernels,
        )  # fmt: skip

    def _params_on_rank(self, layout: Layout) -> tuple[float, float]:
        """Parameters on the first and on the last pipeline rank (per TP shard), routed experts apart
        (_expert_params_on_rank)."""
        p, tp = self.params, layout.tp
        layers = self._max_layers_per_rank(layout)
        body = layers * layer_parameters(self.w.model, tp, layout.ep)[0]
        if layout.pp == 1:
            return body + (p.embedding + p.head + p.final_norm) / tp, body
        head = (
            p.head or self.w.model.vocab_size * self.w.model.hidden_size
        ) / tp  # tied: a copy on the last stage
        return body + p.embedding / tp, body + head + p.final_norm

    def _expert_params_on_rank(self, layout: Layout) -> float:
        """Routed experts' parameters on the fullest rank (its E/ep experts, per TP shard)."""
        return self._max_layers_per_rank(layout) * layer_parameters(self.w.model, layout.tp, layout.ep)[1]

    def _max_layers_per_rank(self, layout: Layout) -> int:
        pp, v, stages = layout.pp, layout.virtual_stages, self.chunk_layers(layout)
        return max(sum(stages[c * pp + r] for c in range(v)) for r in range(pp))

    def chunk_layers(self, layout: Layout) -> tuple[int, ...]:
        """Layers of each model chunk: the layout's own split, else the trainer's (even or by FLOPs)."""
        chunks = layout.pp * layout.virtual_stages
        return layout.stage_layers or stage_layers(self.w.model, chunks, self.sw.balance_stages)

    def rank_modes(self, layout: Layout) -> list[Counter[str]]:
        """Per pipeline rank, how many of its layers (over all its chunks) run each recompute mode."""
        pp, v, stages = layout.pp, layout.virtual_stages, self.chunk_layers(layout)
        if not layout.layer_recompute:
            return [Counter({layout.recompute: sum(stages[c * pp + r] for c in range(v))}) for r in range(pp)]
        starts = list(itertools.accumulate(stages, initial=0))
        out: list[Counter[str]] = [Counter() for _ in range(pp)]
        for chunk, (a, n) in enumerate(zip(starts, stages, strict=False)):
            out[chunk % pp].update(layout.layer_recompute[a : a + n])
        return out

    def memory(self, layout: Layout, inflight: int, num_micro: int) -> dict[str, float]:
        """Bytes on the fullest rank (llmtrain.planner.memory.rank_memory), as MemoryBreakdown.as_dict."""
        return self.breakdown(layout, inflight, num_micro).as_dict()

    def breakdown(self, layout: Layout, inflight: int, num_micro: int) -> MemoryBreakdown:
        """The fullest rank's memory with `inflight` micro-batches in flight on the first pipeline rank."""
        return rank_memory(
            self.w.model,
            self.prec,
            layout,
            self.sw,
            inflight=inflight,
            num_micro=num_micro,
            reserved_bytes=self.dev.reserved_gb * GIB,
            bucket_bytes=self.w.dp_bucket_mb * 2**20,
            counts=self.params,
        )

    # ------------------------------------------------------------------------------------ evaluate

    def invalid_reason(self, layout: Layout) -> str:
        """Why a layout cannot run or is not worth evaluating (empty if neither): the model's TP and pipeline
        rules (llmtrain.config.validate, as a training run checks them), then the batch and the planner's
        own restrictions."""
        m, w = self.w.model, self.w
        if layout.gpus != self.c.devices:
            return f"tp*cp*pp*dp={layout.gpus} != {self.c.devices} GPUs"
        model_rule = tensor_parallel_problem(m, layout.tp, layout.sequence_parallel) or pipeline_problem(
            m.num_layers, layout.pp, layout.virtual_stages, layout.schedule
        )
        if model_rule:
            return model_rule
        chunks = layout.pp * layout.virtual_stages
        if layer_rule := layer_plan_problem(
            m.num_layers, chunks, layout.layer_recompute or (), layout.stage_layers or ()
        ):
            return layer_rule
        full = "full" in layout.layer_modes(m.num_layers)  # MoE refuses full recomputation in any layer
        if trainer_rule := self._config_problem(
            layout.tp, layout.pp, layout.cp, layout.cp_comm, layout.sequence_parallel, layout.zero_stage,
            layout.offload != "none", "full" if full else layout.recompute,
        ):  # fmt: skip
            return trainer_rule
        if expert_rule := self._expert_problem(layout):
            return expert_rule
        if w.global_batch % (layout.dp * layout.micro_batch):
            mbdp = layout.micro_batch * layout.dp
            return f"global batch {w.global_batch} not a multiple of micro_batch*dp={mbdp}"
        if layout.sequence_parallel and layout.tp == 1:
            return "sequence parallelism without tp > 1 changes nothing (use sequence_parallel=false)"
        if sharding := sharding_problem(layout):
            return sharding
        if layout.pp == 1 and layout.schedule != "1f1b":
            return "pp=1 runs no pipeline schedule (use 1f1b)"
        if (
            layout.schedule == "interleaved_1f1b"
            and (w.global_batch // (layout.dp * layout.micro_batch)) % layout.pp
        ):
            return "interleaved_1f1b needs the micro-batches per step to be a multiple of pp"
        return ""

    def _trainer_problem(
        self, tp: int, pp: int, cp: int, cp_comm: str, sp: bool, zero: int, offload: bool, recompute: str
    ) -> str:
        """What config validation says of a layout's context parallelism and mixture of experts (the rules
        a training run checks: llmtrain.config.validate), "" if it runs."""
        m = self.w.model
        if cp == 1 and not m.is_moe:
            return ""
        job = JobConfig(
            model=replace(m, recompute=recompute),
            parallel=ParallelConfig(
                tp=tp, pp=pp, cp=cp, cp_comm=cp_comm, sequence_parallel=sp, zero_stage=zero,  # type: ignore[arg-type]
                engine="deepspeed" if offload else "llmtrain",
            ),
            train=TrainConfig(precision=self.prec),  # type: ignore[arg-type]
        )  # fmt: skip
        return context_parallel_problem(job) or moe_problem(job)

    def _expert_problem(self, layout: Layout) -> str:
        """Why a layout's expert parallelism cannot run ("" if it can): ep > 1 needs routed experts, ep
        dividing their number, and ep ranks carved out of the tp x cp x dp ranks as the trainer carves them
        (llmtrain.config.validate.expert_layout_problem: inside dp, spanning cp, or spanning tp)."""
        m, ep = self.w.model, layout.ep
        if ep == 1:
            return ""
        if not m.is_moe:
            return f"ep={ep}: model.arch={m.arch} has no experts (expert parallelism needs a MoE arch)"
        if m.num_experts % ep:
            return f"ep={ep} does not divide model.num_experts={m.num_experts}"
        parallel = ParallelConfig(tp=layout.tp, cp=layout.cp, ep=ep)
        return expert_layout_problem(parallel, layout.dp)

    def _data_parallel_time(
        self, layout: Layout, num_micro: int, fwd: float, bwd: float
    ) -> tuple[float, float, float]:
        """(DP communication, its exposed part, optimizer step) in seconds; `fwd`/`bwd` are one micro-batch's
        forward and backward on the first rank, the windows the collectives hide behind.

        zero 0 all-reduces the gradients once per step, zero 1 reduce-scatters them and all-gathers the
        updated 16-bit parameters; zero 2/3 (FSDP2) reduce-scatter in every micro-batch's backward (or, with
        grad_reduce=step, once per step at the last micro-batch's, the others accumulating unsharded
        gradients), and gather each block's parameters in every micro-batch's forward, zero 3 again in its
        backward (traced:
        tests/planner/test_collectives.py). Hybrid sharding adds an all-reduce of the shard across the
        replicas. Offload copies the gradient shard to the host and the updated parameters back, and runs
        Adam on the host's cores; with the parameters offloaded the shards also cross the host link at every
        gather.
        """
        params = max(self._params_on_rank(layout))
        experts = self._expert_params_on_rank(layout)
        z, tp, e, g = layout.zero_stage, layout.tp, self.act_bytes, self.sw.grad_bytes
        dp = layout.dp * layout.cp  # context-parallel ranks hold the same parameters: reduced together
        shard = shard_group(layout)
        xgroup, xshard = expert_dp_size(layout), expert_shard_group(layout)
        xstride = self._expert_strides(layout)[1] if experts else 1
        fsdp = layout.fsdp
        reductions = layout.reductions(num_micro)
        calls = 0
        if z == 0:
            reduce, gather = self.c.all_reduce(params * g, dp, tp), 0.0
        elif fsdp:
            # FSDP2 issues one collective per unit (collectives.py counts them): per-call costs (latency,
            # the framework's per-call host time) scale with the units, not with the bytes alone.
            # Expert units on their own mesh (the expert-data-parallel group: collectives._dp_collectives).
            units = [
                (n, 2 if reshard else 1, (xshard, xstride) if expert else (shard, tp))
                for n, reshard, expert in self._fsdp_units(layout, 0)
            ]
            reduce = sum(self.c.reduce_scatter(n * g, *where) for n, _, where in units)
            # Per gather round (a micro-batch's forward, at zero 3 also its backward), as `gathers` counts.
            gather = sum(k * self.c.all_gather(n * e, *where) for n, k, where in units)
            gather /= 2 if z == 3 else 1
            calls = sum((reductions + num_micro * k) * (where[0] > 1) for _, k, where in units)
        else:
            reduce = self.c.reduce_scatter(params * g, shard, tp)
            gather = self.c.all_gather(params * e, shard, tp)
        if z > 0 and shard < dp:  # hybrid sharding: the shard all-reduced across the replicas
            reduce += self.c.all_reduce(params * g / shard, dp // shard, tp * shard)
        if experts and not fsdp:
            # Routed experts over the expert-data-parallel group: the ranks holding the same ones, spread
            # over the tp x cp x dp ranks of the stage (_expert_strides).
            if z == 0:
                reduce += self.c.all_reduce(experts * g, xgroup, xstride)
            else:
                reduce += self.c.reduce_scatter(experts * g, xshard, xstride)
                gather += self.c.all_gather(experts * e, xshard, xstride)
        gathers = num_micro * (2 if z == 3 else 1) if z >= 2 else 1
        reduce, gather = reduce * reductions, gather * gathers if z else 0.0
        if self.sw.dp_overlap and dp > 1:
            # The first bucket (block) of each collective waits for its data; the rest hides behind compute.
            first = min(self.w.dp_bucket_mb * 2**20 / max((params + experts) * g, 1.0), 1.0)
            exposed = reductions * max(reduce / reductions - bwd, first * reduce / reductions)
            if z >= 2:
                exposed += gathers * max(gather / gathers - min(fwd, bwd), first * gather / gathers)
            elif self.sw.overlap_param_gather:
                # ZeRO-1: the updated parameters' gathers are waited for by the next step's first forward,
                # module by module (parallel.overlap_param_gather).
                exposed += max(gather - fwd, first * gather)
            else:
                exposed += gather
        else:
            exposed = reduce + gather
        # The framework's own host time per FSDP2 collective (hooks, copy-in/out, DTensor bookkeeping) is
        # not overlapped: the collective cannot start before it.
        exposed += calls * self.dev.fsdp_call_us * 1e-6
        local = params / shard + experts / xshard
        if layout.offload == "none":
            # Adam: read grad, master, m, v; write master, m, v, the 16-bit weights; plus the grad norm.
            optimizer = self.dev.memory_time(local * (g * 2 + 4 * 6 + e), kernels=4)
        else:
            host = self.dev.host_bandwidth_gbs * 1e9
            optimizer = local * (g + 4) / host + local / (self.dev.host_adam_gparams * 1e9)
            if layout.offload == "optimizer+params":
                exposed += gathers * local * 4 / host
        return reduce + gather, exposed, optimizer

    def collectives(self, layout: Layout, pp_rank: int = 0) -> Counter[C.Comm]:
        """The collectives and sends one training step issues on a rank of pipeline stage `pp_rank`, with how
        often each: what tests/planner/test_collectives.py compares with the trainer's traced step.

        Per micro-batch and chunk the TP collectives of its layers (and of the embedding on the first
        stage, the output layer and loss on the last), the activation sent forward and its gradient sent
        back at every stage boundary; per step the loss broadcast from the last stage, the tied embedding's
        gradient sum, the SP-replicated gradients' all-reduce over TP, the gradient norm's all-reduce, and
        the data-parallel gradient reduction (and ZeRO-1 parameter gather) over the gradient buffer's
        buckets (collectives.buckets: the same bytes, the bucket count an estimate). Under context
        parallelism each layer adds its ring sends or all-to-alls (collectives.cp_layer), the last stage the
        loss's sums over cp, each MoE layer its router statistics' sums over tp and cp (collectives.
        router_stats), and the gradients are reduced over dp x cp. Under expert parallelism each MoE
        layer adds its all-to-alls (collectives.ep_layer of collectives.routed_rows, balanced routing), the
        routed experts' gradients are all-reduced apart over the expert-data-parallel group (memory.
        expert_dp_size: tp x cp x dp / ep ranks) at zero 0, their shards exchanged there at zero 1 (gloo:
        sends to each peer), or gathered and reduce-scattered there as FSDP2 units of their own at zero 2/3,
        and the gradient norm is summed over the world."""
        m, tp, pp, v, dp, cp = self.w.model, layout.tp, layout.pp, layout.virtual_stages, layout.dp, layout.cp
        sp, e, b = layout.sequence_parallel, self.act_bytes, layout.micro_batch
        sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        num_micro = self.w.global_batch // (dp * b)
        tok = b * self.w.seq // cp
        activation = e * tok * m.hidden_size
        stages = self.chunk_layers(layout)
        out: Counter[C.Comm] = Counter()

        def add(comms: tuple[C.Comm, ...], times: int) -> None:
            for c in comms:
                out[c] += times

        modes = layout.layer_modes(m.num_layers)
        starts = list(itertools.accumulate(stages, initial=0))
        heads, kv = m.num_attention_heads // tp, max(m.kv_heads // tp, 1)
        numel = replicated = partial = kv_replicated = 0
        ep = layout.ep
        moe_extra, routed, moe_partial = C.moe_layer_parameters(m, tp, ep)
        experts = 0
        emb, head = C.edge_layers(tp, sp, dp if edges_vocab_sharded(layout, m) else 1, activation, tok)
        for chunk in range(v):
            stage = chunk * pp + pp_rank
            first, last = stage == 0, stage == pp * v - 1
            layers = range(starts[stage], starts[stage + 1])
            for (mode, moe), n in Counter((modes[i], m.is_moe_layer(i)) for i in layers).items():
                layer = C.tp_layer(tp, activation, sp, mode, moe, m.arch == "deepseek_v3")
                context = C.cp_layer(cp, layout.cp_comm, tok, heads, kv, m.head_size, e, mode)
                add(layer.fwd + layer.bwd + context.fwd + context.bwd, num_micro * n)
                if moe:
                    rows = C.routed_rows(tok, m.num_experts_per_tok, tp)
                    expert = C.ep_layer(ep, m.num_experts, rows, e * m.hidden_size, mode)
                    stats = C.router_stats(m.num_experts, tp, cp, mode)
                    add(expert.fwd + expert.bwd + stats.fwd + stats.bwd, num_micro * n)
                    numel += (moe_extra + (routed if ep == 1 else 0)) * n
                    partial += moe_partial * n
                    experts += (routed if ep > 1 else 0) * n
            if first:
                add(emb.fwd + emb.bwd, num_micro)
            if last:
                add(head.fwd + head.bwd + C.cp_loss(cp).fwd, num_micro)
            sends = num_micro * ((not last) + (not first))
            if sends:
                out[C.Comm("send", "pp", 2, activation // (tp if sp else 1))] += sends
            n, r = C.rank_parameters(m, tp, stages[stage], first, last)
            partial += F.attention_whole_parameters(m) * stages[stage] if tp > 1 else 0
            kv_replicated += C.kv_replica_parameters(m, tp) * stages[stage]
            numel, replicated = numel + n, replicated + r
        if pp > 1:
            out[C.Comm("broadcast", "pp", pp, 4)] += 1  # the mean loss, from the last stage
            tied = m.tied_embeddings and pp_rank in (0, pp - 1)
            if tied:
                out[C.Comm("all_reduce", "pp", 2, 4 * m.vocab_size // tp * m.hidden_size)] += 1
        # One all-reduce over TP of the gradients that are partial sums there: the SP-replicated ones, and
        # (with SP or without) the MoE layers' and QK-norms' (reduce_tp_grads).
        summed = (replicated if sp else 0) + partial
        # FSDP2 sums this rank's shards of them (dim 0 split over dp; exact when it divides).
        shards = dp if layout.zero_stage >= 2 else 1
        if tp > 1 and summed:
            out[C.Comm("all_reduce", "tp", tp, 4 * summed // shards)] += 1
        if kv_replicated:
            # tp > kv heads: each kv head's projections sit on tp / kv ranks, whose gradients are summed by
            # one all-gather over TP (reduce_tp_grads; its record is the gathered bytes).
            out[C.Comm("all_gather", "tp", tp, tp * 4 * kv_replicated // shards)] += 1
        # Under EP every rank's expert gradients differ: the norm is summed over the world.
        sharded_norm = (layout.zero_stage >= 1 and dp * cp > 1) or ep > 1
        norm_dims = ("tp", "cp", "pp", "dp") if sharded_norm else ("tp", "pp")
        norm_size = tp * pp * (dp * cp if sharded_norm else 1)
        if norm_size > 1:
            out[C.Comm("all_reduce", C.group_name(norm_dims, sizes), norm_size, 8)] += 1
        edp = expert_dp_size(layout)
        # FSDP2's expert units reduce over the expert-DP ranks even without dense data parallelism (dp x cp
        # = 1 with EP inside TP).
        if dp * cp > 1 or (experts and edp > 1 and layout.zero_stage >= 2):
            for comm, times in self._dp_collectives(layout, numel, v, pp_rank).items():
                out[comm] += times
        if experts and edp > 1 and layout.zero_stage <= 1:
            # Their own fp32 buckets over the ranks holding the same experts: all-reduced (zero 0), or
            # reduce-scattered with the updated parameters gathered (zero 1), on gloo by exchanging shards
            # with each peer (sends named by the dimensions the peer differs in).
            count = C.buckets(experts // v, int(self.w.dp_bucket_mb * 2**20 / 4)) * v
            bucket, g = experts // count, self.sw.grad_bytes
            if layout.zero_stage == 0:
                out[C.Comm("all_reduce", "edp", edp, bucket * g)] += count
            elif self.sw.gloo_shard_exchange:
                for peer in C.expert_dp_peers(tp, cp, dp, layout.ep):
                    out[C.Comm("send", peer, 2, bucket * g // edp)] += count
                    out[C.Comm("send", peer, 2, bucket * e // edp)] += count
            else:
                out[C.Comm("reduce_scatter", "edp", edp, bucket * g)] += count
                out[C.Comm("all_gather", "edp", edp, bucket * e)] += count
        return out

    def _dp_collectives(self, layout: Layout, numel: int, chunks: int, pp_rank: int) -> Counter[C.Comm]:
        """The data-parallel reduction of one step over `numel` gradients of the rank (in `chunks` buffers):
        zero 0 all-reduces each fp32 bucket; zero 1 reduce-scatters it and all-gathers the updated
        parameters; zero 2/3 (FSDP2) gather each unit's parameters at every micro-batch's forward (zero 3
        again in its backward) and reduce-scatter its gradients in every micro-batch's backward (with
        grad_reduce=step once per step: sync is off for every micro-batch but the last). On gloo both stages
        do it by point-to-point exchange of the shards with each peer (Software.gloo_shard_exchange). The
        group is dp x cp (the CP ranks hold the same parameters); the gloo exchange's sends are named by
        the dimensions in which each peer differs."""
        g, e, cp = self.sw.grad_bytes, self.act_bytes, layout.cp
        dp = layout.dp * cp
        sizes = {"cp": cp, "dp": layout.dp}
        group = C.group_name(("cp", "dp"), sizes)
        num_micro = self.w.global_batch // (layout.dp * layout.micro_batch)
        count = C.buckets(numel // chunks, int(self.w.dp_bucket_mb * 2**20 / 4)) * chunks
        bucket = numel // count
        # (gathered bytes, reduced bytes, how many of each, expert unit): the buckets, or the FSDP2 units.
        # Expert units (under EP) are sharded over the ranks holding the same experts; one reduces nothing.
        edp = expert_dp_size(layout)
        if layout.zero_stage == 1:
            pieces = [(bucket * e, bucket * g, count, count, False)]
        else:
            pieces = [
                (unit * e, unit * 4, num_micro * (2 if reshard else 1), layout.reductions(num_micro), expert)
                for unit, reshard, expert in self._fsdp_units(layout, pp_rank)
            ]
        out: Counter[C.Comm] = Counter()
        if layout.zero_stage == 0:
            out[C.Comm("all_reduce", group, dp, bucket * g)] = count
        elif self.sw.gloo_shard_exchange:
            peers = [
                C.group_name(tuple(n for n, i in (("cp", c), ("dp", d)) if i), sizes)
                for c, d in itertools.product(range(cp), range(layout.dp))
                if c or d
            ]
            expert_peers = C.expert_dp_peers(layout.tp, cp, layout.dp, layout.ep)
            for gathered, reduced, gathers, reductions, expert in pieces:
                size = edp if expert else dp
                for peer in expert_peers if expert else peers:
                    out[C.Comm("send", peer, 2, gathered // size)] += gathers
                    out[C.Comm("send", peer, 2, reduced // size)] += reductions
        else:
            for gathered, reduced, gathers, reductions, expert in pieces:
                name, size = ("edp", edp) if expert else (group, dp)
                if size > 1:
                    out[C.Comm("all_gather", name, size, gathered)] += gathers
                    out[C.Comm("reduce_scatter", name, size, reduced)] += reductions
        return out

    def _fsdp_units(self, layout: Layout, pp_rank: int) -> list[tuple[int, bool, bool]]:
        """(parameters, reshard after forward, expert) of each FSDP2 unit of a rank (llmtrain.parallel.fsdp):
        every block (resharded at zero 3), under EP a MoE block's routed experts as a unit of their own on
        the expert-data-parallel mesh (expert true), the embedding (idem) and the final norm with the output
        layer as units of their own unless tied in one chunk, and the root with what is left (kept
        gathered)."""
        m, tp, pp, v, ep = self.w.model, layout.tp, layout.pp, layout.virtual_stages, layout.ep
        z3 = layout.zero_stage == 3
        stages = self.chunk_layers(layout)
        starts = list(itertools.accumulate(stages, initial=0))
        dense = C.rank_parameters(m, tp, 1, False, False)[0]
        moe_extra, routed, _ = C.moe_layer_parameters(m, tp, ep)

        def blocks(stage: int) -> list[tuple[int, bool, bool]]:
            out = []
            for i in range(starts[stage], starts[stage + 1]):
                if not m.is_moe_layer(i):
                    out.append((dense, z3, False))
                elif ep > 1:
                    out += [(dense + moe_extra, z3, False), (routed, z3, True)]
                else:
                    out.append((dense + moe_extra + routed, z3, False))
            return out

        embedding = m.vocab_size // tp * m.hidden_size
        positions = m.max_positions * m.hidden_size if m.arch == "gpt" else 0
        norm = 2 * m.hidden_size if m.arch == "gpt" else m.hidden_size
        if edges_vocab_sharded(layout, m):
            # One chunk; the embedding and head are units that are never gathered, whose gradients land on
            # their shards (collectives.vocab_sharded_edges): the root keeps the final norm.
            return [*blocks(0), (norm + positions, False, False)]
        units: list[tuple[int, bool, bool]] = []
        for chunk in range(v):
            stage = chunk * pp + pp_rank
            first, last = stage == 0, stage == pp * v - 1
            units += blocks(stage)
            if first and last and m.tied_embeddings:
                units.append((embedding + positions + norm, False, False))
                continue
            if first:
                units.append((embedding, z3, False))
            if last:
                units.append((norm + embedding, False, False))
            if first and positions:
                units.append((positions, False, False))
        return units

    def _overflow(self, mem: dict[str, float]) -> str:
        """Why a layout does not fit: its steady state and/or its startup peak, each with its cause."""
        cap = self.dev.memory_gb
        reasons = []
        if mem["steady"] > cap * GIB:
            top = max(("params", "grads", "optimizer", "activations", "gathered"), key=lambda k: mem[k])
            reasons.append(
                f"needs {mem['steady'] / GIB:.1f} GiB > {cap:g} GiB (largest: {top} {mem[top] / GIB:.1f} GiB)"
            )
        if mem["startup"] > cap * GIB:
            built = (
                "its own shards plus one block in fp32"
                if self.sw.sharded_init
                else "every rank builds the whole model in fp32 first; needs sharded construction"
            )
            reasons.append(f"startup peak {mem['startup'] / GIB:.1f} GiB > {cap:g} GiB ({built})")
        return "; ".join(reasons)

    def rank_costs(self, layout: Layout) -> tuple[list[float], ...]:
        """Per pipeline rank, the costs of ONE chunk's pass of one micro-batch: forward, backward, weight
        gradient, and the tensor-parallel, recompute, context-parallel and expert-parallel parts of them."""
        tp, pp, v, b = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batch
        sp, cp = layout.sequence_parallel, layout.cp
        vocab_dp = layout.dp if edges_vocab_sharded(layout, self.w.model) else 1
        first, last = self._extras(tp, b, sp, cp, vocab_dp)

        ep_dp = layout.dp if layout.ep > 1 else 1  # places the EP group; 1 keeps the cache small without EP

        def layer_of(mode: str) -> _Pass:
            return self._layer(tp, b, sp, mode, cp, layout.cp_comm, layout.ep, ep_dp)

        none = layer_of("none")
        accumulation = self._accumulation_time(layout)
        # Per-rank per-chunk costs from each rank's layers (the trainer's split, even or balanced by FLOPs, or
        # the layout's own) and their recompute modes.
        fwd, bwd, wgt, tpc, rec, cpc, epc = [], [], [], [], [], [], []
        for modes in self.rank_modes(layout):
            f = bk = wg = tcomm = redo = ccomm = ecomm = 0.0
            for mode, count in modes.items():
                layer, n = layer_of(mode), count / v
                f += n * (layer.fwd + layer.tp_fwd + layer.cp_fwd + layer.ep_fwd)
                bk += n * (layer.bwd + layer.tp_bwd + layer.cp_bwd + layer.ep_bwd)
                wg += n * layer.wgrad
                tcomm += n * (layer.tp_fwd + layer.tp_bwd)
                ccomm += n * (layer.cp_fwd + layer.cp_bwd)
                ecomm += n * (layer.ep_fwd + layer.ep_bwd)
                redo += n * (layer.bwd - none.bwd)
            r = len(fwd)
            cpc.append(ccomm)
            epc.append(ecomm)
            if r == 0:
                f += (first.fwd + first.tp_fwd) / v
                bk += (first.bwd + first.tp_bwd) / v
                tcomm += (first.tp_fwd + first.tp_bwd) / v
            if r == pp - 1:
                f += (last.fwd + last.tp_fwd) / v
                bk += (last.bwd + last.tp_bwd) / v
                wg += last.wgrad / v
                tcomm += (last.tp_fwd + last.tp_bwd) / v
            bk += accumulation[min(r, 1)] / v
            fwd.append(f)
            bwd.append(bk)
            wgt.append(min(wg, bk))
            tpc.append(tcomm)
            rec.append(redo)
        return fwd, bwd, wgt, tpc, rec, cpc, epc

    def _accumulation_time(self, layout: Layout) -> tuple[float, float]:
        """(first pipeline rank, the others: the last's) seconds a micro-batch's backward spends adding its
        gradients into the rank's fp32 gradient buffer (llmtrain: autograd adds in place into the
        buffer-backed .grad, or DataParallel adds the 16-bit gradient into main_grad: read both, write one),
        unless the weight-gradient matmuls accumulate into the buffer themselves (Software.
        grad_accumulation_fusion). The pass streams the whole buffer: on the reference path at the memory
        table's rate for its size (a CPU's beyond its caches); on a GPU at its memory bandwidth (an A100's
        fp32 buffer costs about 400 / tokens-per-micro-batch of the micro-batch's matmul time: it matters
        at small micro-batches)."""
        if self.sw.grad_accumulation_fusion:
            return 0.0, 0.0
        experts = self._expert_params_on_rank(layout)
        times = []
        for params in self._params_on_rank(layout):
            nbytes = self.sw.grad_bytes * (params + experts)
            # Read the buffer and the new gradient (4 bytes each, or 2 for a 16-bit one), write the buffer.
            moved = nbytes * (2 + self.act_bytes / self.sw.grad_bytes)
            times.append(self.dev.memory_time(moved, tensor_bytes=0.0 if self.sw.fused_kernels else nbytes))
        return times[0], times[1]

    def p2p_time(self, layout: Layout) -> float:
        """Seconds of one pipeline send of a micro-batch's activation (0 without pipeline parallelism)."""
        tp, pp, cp, b = layout.tp, layout.pp, layout.cp, layout.micro_batch
        send = self.act_bytes * b * self.w.seq // cp * self.w.model.hidden_size
        split = layout.sequence_parallel or self.sw.p2p_scatter_gather
        cross = self.c.spans_nodes(pp, tp * cp * layout.dp)
        p2p = self.c.p2p(send / (tp if split else 1), cross) if pp > 1 else 0.0
        if split and not layout.sequence_parallel and tp > 1 and pp > 1:
            p2p += self.c.all_gather(send, tp)  # scatter/gather re-assembles the activation over NVLink
        return p2p

    def evaluate(self, layout: Layout, use_simulator: bool = False) -> Estimate:
        """Predicted step time, breakdown and memory of `layout` (raises ValueError if it cannot run)."""
        why = self.invalid_reason(layout)
        if why:
            raise ValueError(f"layout {layout.short()} is invalid: {why}")
        pp, v, b = layout.pp, layout.virtual_stages, layout.micro_batch
        num_micro = self.w.global_batch // (layout.dp * b)
        fwd, bwd, wgt, tpc, rec, cpc, epc = self.rank_costs(layout)
        p2p = self.p2p_time(layout)
        pipe: PipelineTime = pipeline_time(
            layout.schedule, pp, num_micro, v, fwd, bwd, wgt, p2p, use_simulator
        )

        busiest = max(range(pp), key=lambda r: fwd[r] + bwd[r])
        tp_total = num_micro * v * tpc[busiest]
        cp_total, ep_total = num_micro * v * cpc[busiest], num_micro * v * epc[busiest]
        compute = pipe.busy - tp_total - cp_total - ep_total
        # The pipeline's step without transfers: what the sends add to the bubble.
        quiet = pipeline_time(layout.schedule, pp, num_micro, v, fwd, bwd, wgt, 0.0, use_simulator)
        p2p_exposed = min(max(pipe.step_time - quiet.step_time, 0.0), pipe.step_time - pipe.busy)

        dp_comm, exposed, optimizer = self._data_parallel_time(layout, num_micro, fwd[0] * v, bwd[0] * v)
        step = pipe.step_time + exposed + optimizer

        mem = self.memory(layout, pipe.peak_inflight, num_micro)
        capacity = self.dev.memory_gb * GIB
        fits = mem["total"] <= capacity
        why = "" if fits else self._overflow(mem)
        tokens = self.w.global_batch * self.w.seq
        modes = Counter(layout.layer_modes(self.w.model.num_layers))
        executed = sum(self._flops[m] * n for m, n in modes.items()) / modes.total() * tokens
        model_flops = self._model_flops * tokens
        gpus = layout.gpus
        return Estimate(
            layout=layout,
            step_time=step,
            compute=compute,
            tp_comm=tp_total,
            pp_bubble=pipe.step_time - pipe.busy,
            dp_comm=dp_comm,
            dp_exposed=exposed,
            optimizer=optimizer,
            recompute=num_micro * v * rec[busiest],
            pp_p2p=p2p_exposed,
            bubble_fraction=pipe.bubble_fraction,
            memory=mem,
            capacity=capacity,
            fits=fits,
            why=why,
            tflops_per_gpu=executed / step / gpus / 1e12,
            mfu=model_flops / step / gpus / self.dev.peak_flops(self.prec),
            simulated=pipe.simulated,
            cp_comm=cp_total,
            ep_comm=ep_total,
        )


def sharding_overrides(layout: Layout) -> dict[str, object]:
    """The config overrides of a layout's hybrid sharding, once-a-step gradient reduction and offload, only
    when it uses them (offload runs through the DeepSpeed engine)."""
    out: dict[str, object] = {}
    if layout.dp_shard is not None:
        out["parallel.dp_shard"] = layout.dp_shard
    if layout.reduces_once_a_step:
        out["parallel.grad_reduce"] = "step"
    if layout.offload != "none":
        out["parallel.engine"] = "deepspeed"
        out["parallel.offload"] = layout.offload
    return out


def parallel_overrides(layout: Layout) -> dict[str, object]:
    """The config overrides of a layout's context and expert parallelism."""
    return {"parallel.cp": layout.cp, "parallel.cp_comm": layout.cp_comm, "parallel.ep": layout.ep}


def with_layout(job: JobConfig, layout: Layout, global_batch: int | None = None) -> JobConfig:
    """A copy of `job` running `layout` (and `global_batch` if given): what --write produces."""
    model = replace(
        job.model, recompute=layout.recompute, recompute_layers=list(layout.layer_recompute or ())
    )
    context = {key.removeprefix("parallel."): value for key, value in parallel_overrides(layout).items()}
    parallel = replace(
        job.parallel,
        **context,  # type: ignore[arg-type]
        stage_layers=list(layout.stage_layers or ()),
        dp_shard=layout.dp_shard,
        engine="deepspeed" if layout.offload != "none" else job.parallel.engine,
        offload=layout.offload,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        virtual_stages=layout.virtual_stages,
        schedule=layout.schedule,
        sequence_parallel=layout.sequence_parallel,
        zero_stage=layout.zero_stage,
        # Only FSDP2 (zero 2/3 on llmtrain's engine) has the choice; the others refuse "step".
        grad_reduce="step" if layout.reduces_once_a_step else "microbatch",
        auto=False,
    )
    train = replace(
        job.train,
        micro_batch_size=layout.micro_batch,
        global_batch_size=global_batch or job.train.global_batch_size,
    )
    return replace(job, model=model, parallel=parallel, train=train)


def layout_of_job(job: JobConfig, gpus: int, fixed: dict[str, object] | None = None) -> Layout:
    """The layout `job` runs on `gpus` devices (dp = gpus / (tp * cp * pp)), with the `fixed` settings
    (Layout field names, as parse_fixed gives them) replacing the config's."""
    p = job.parallel
    model_parallel = p.tp * p.cp * p.pp
    layout = Layout(
        tp=p.tp,
        pp=p.pp,
        dp=max(gpus // model_parallel, 1),
        micro_batch=job.train.micro_batch_size,
        virtual_stages=p.virtual_stages,
        schedule=p.schedule,
        recompute=job.model.recompute,
        sequence_parallel=p.sequence_parallel,
        zero_stage=p.zero_stage,
        dp_shard=None if p.dp_shard in (None, gpus // model_parallel) else p.dp_shard,  # = dp: plain
        offload=p.offload,
        layer_recompute=tuple(job.model.recompute_layers) or None,
        stage_layers=tuple(p.stage_layers) or None,
        cp=p.cp,
        cp_comm=p.cp_comm,
        ep=p.ep,
        grad_reduce=p.grad_reduce,
    )
    layout = replace(layout, **(fixed or {}))
    if "dp" not in (fixed or {}):
        layout = replace(layout, dp=max(gpus // (layout.tp * layout.cp * layout.pp), 1))
    return layout
