"""What the cost model evaluates: a parallel layout, the framework's behaviour and the workload, and how a
layout maps onto a job config (the overrides `parallel.auto` applies, the config `--write` writes) and back.

Pure data: nothing here costs anything (llmtrain.planner.cost.model does).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from llmtrain.config.layout_rules import V_SCHEDULES
from llmtrain.config.schema import JobConfig, ModelConfig
from llmtrain.pipeline.schedules import rank_of_stage, stage_of

GIB = 2.0**30
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe", "zb_v", "dualpipe_v", "interleaved_zb")


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

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The global stages pipeline rank `pp_rank` holds, chunk by chunk (looped, or in a V)."""
        v_shape = self.schedule in V_SCHEDULES
        return [stage_of(v_shape, self.pp, pp_rank, c) for c in range(self.virtual_stages)]

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank holding global `stage`."""
        return rank_of_stage(self.schedule in V_SCHEDULES, self.pp, stage)[0]

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
    fused_ring_attention: bool = False
    """Ring context parallelism computes each block pair with a fused flash-attention kernel (Transformer
    Engine's p2p context parallelism, torchtitan's); false: llmtrain's PyTorch block matmuls in fp32."""
    fused_moe_permute: bool = False
    """Routed rows are permuted into expert order and back, weighted by their routing probabilities, by fused
    kernels (Megatron-Core's and Transformer Engine's permute/unpermute, DeepEP): one read and one write of
    each row each way; false: llmtrain's gather, concatenation, fp32 weighting and index-add passes."""
    causal_skip: bool = False
    """Fused attention computes only the causal (lower-triangle) blocks of the scores, half the score FLOPs
    (Transformer Engine's cuDNN and flash-attention kernels); false: the whole s x s counted."""
    te_fp8: bool = False
    """FP8 linears as Transformer Engine runs them: fused cast-transposes (one read of bf16, the amax in the
    same pass), weights cast once per step (cached across micro-batches), linear inputs saved for backward
    in float8, and the MoE experts' grouped GEMM in FP8; false: llmtrain's torchao casts (a separate amax
    pass, every cast every micro-batch), inputs saved in bf16, the grouped GEMM in bf16."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives overlap the layer's GEMMs (Transformer Engine's userbuffers, as Megatron's
    tp_comm_overlap): only the part longer than the pass's GEMMs is exposed; false: all exposed."""
    tp_saves_gathered_input: bool = False
    """Under sequence parallelism each TP region gathers its input once, and its column-parallel linears keep
    the gathered tensor for their backward (DTensor's PrepareModuleInput + ColwiseParallel, as torchtitan
    applies them): no re-gather in the backward, and the QKV and MLP inputs saved whole; false: llmtrain
    (and Megatron-Core), which keep the sequence shard and all-gather it again in the backward."""
    float8_tp: bool = False
    """Under fp8 with the tensorwise recipe, sequence parallelism's all-gathers carry float8, 1 byte an
    element: each region's input is cast before it is gathered, and the row-parallel outputs' gradients are
    cast before the backward gathers them (torchao's PrepareFloat8ModuleInput, Float8ColwiseParallel and
    Float8RowwiseParallel, which torchtitan applies under tensorwise float8); the reduce-scatters of the
    partial outputs and input gradients stay bf16."""
    async_tp: bool = False
    """Sequence parallelism's all-gathers and reduce-scatters run micro-pipelined with the matmuls they feed
    or are fed by (torch's symmetric-memory fused all-gather-matmul and matmul-reduce-scatter, torchtitan's
    async TP): the tensor moves in tp chunks, each overlapping another chunk's matmul; one chunk's transfer
    stays exposed, and the rest where it outlasts the matmul (layer_time.micro_pipelined)."""
    compiled_float8: bool = False
    """Under fp8 with the tensorwise recipe, torchao's float8 linears run under torch.compile, whose Inductor
    kernels fuse the scaling (torchao's float8 README and roofline model, torchtitan's "required for
    competitive performance"): an activation's amax (the linear's input forward, its output gradient
    backward) is reduced inside the kernel that produces the tensor, and one cast pass reads it and writes
    its float8 copy in both layouts (the forward GEMM's and the weight-gradient GEMM's), so the input is not
    cast again in the backward; a weight, produced by no kernel of the graph, keeps its amax pass and is cast
    once forward and once backward (layer_time._float8_cast_bytes); false: llmtrain's eager torchao casts."""

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
    optimizer: str = "adamw"
    """train.optimizer: adamw, or muon (one momentum buffer and a whole-matrix all-reduce for the blocks)."""
    fp8_recipe: str = "tensorwise"
    """train.fp8_recipe under precision fp8."""
    fp8_all_gather: bool | None = None
    """train.fp8_all_gather: ZeRO-3 gathers the float8 linears' weights in float8 (null: where it applies)."""
    fp8_filter: str = "all"
    """train.fp8_filter: all block linears in float8, or auto (engine_rules.small_gemm's stay bf16)."""
    fp8_grouped_mm: str = "auto"
    """train.fp8_grouped_mm: the routed experts' grouped GEMM under fp8 (auto, rowwise, mxfp8, bf16)."""

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
            optimizer=job.train.optimizer,
            fp8_recipe=job.train.fp8_recipe,
            fp8_all_gather=job.train.fp8_all_gather,
            fp8_filter=job.train.fp8_filter,
            fp8_grouped_mm=job.train.fp8_grouped_mm,
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
