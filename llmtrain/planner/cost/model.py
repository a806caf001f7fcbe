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
  through llmtrain.planner.cost.pipeline_time (the pipeline simulator or its closed forms), with the
  activation send as the point-to-point cost.
- context parallelism (cp): each rank holds b*s/cp tokens, so projections, MLP and memory-bound kernels run on
  a cp-th of the tokens and the attention core on a cp-th of the score square (the two mirrored chunks
  balance the causal mask). ring: the attention runs as PyTorch block matmuls in fp32 (2cp+1 visible chunk
  pairs of (s/2cp)^2, recomputed in the backward), each step's fp32 K/V transfer overlapped with that step's
  blocks (exposed: max(0, transfer - compute) per step; the backward also carries dK/dV and sends them
  home; Software.fused_ring_attention: flash-attention kernels per block pair instead, as Transformer
  Engine and torchtitan run it); all_to_all: the fused kernel over the whole sequence for a/cp heads, and 4
  all-to-alls (q, k, v, output) of the rank's activation in the forward and 4 in the backward, not
  overlapped. The gradients are reduced over dp x cp (collectives.cp_layer and
  tests/planner/test_collectives.py, traced).
- mixture of experts: routed experts' matmuls run on top-k rows per token (times Software.moe_imbalance, the
  busiest rank's load over the mean) spread over the E/ep experts of the rank, plus the router and shared
  experts; under TP each TP rank routes 1/tp of the tokens with the MoE weights whole (no MLP region, the
  router statistics all-reduced over TP and CP). Expert parallelism (ep ranks carved out of the tp x cp x dp
  ranks as the trainer carves them: inside dp, spanning cp or tp) adds a dispatch and a combine all-to-all
  of the rank's routed rows x hidden per MoE layer in the forward and again in the backward, on the links
  the ep group spans (collectives.expert_group_strides), slowed where the EP and DP groups both cross nodes
  by the DP traffic hidden behind compute, which still occupies the NICs (_ep_link_sharing); the routed rows'
  permutation costs llmtrain's gather/concatenate/fp32-weighting passes, or one read and write each way with
  Software.fused_moe_permute (Megatron-Core, DeepEP); routed experts' gradients are reduced over the
  expert-data-parallel group (tp x cp x dp / ep), under FSDP2 as units of their own on that group.
- latent attention (deepseek_v3): the up-projections and o_proj split by heads over TP, the down-projections
  and their norms whole on every rank (their gradients in the TP all-reduce of partial sums).
- data parallelism: gradient all-reduce (ZeRO-0) or reduce-scatter plus parameter all-gather (ZeRO-1) over
  the DP group, overlapped with the last micro-batch's backward when the framework overlaps it; then the
  optimizer step, memory-bound over the rank's (sharded) fp32 state.
Memory per rank: weights, gradients and optimizer state per precision and ZeRO stage; activations per layer
after Korthikanti et al. 2022 (generalised to GQA, gated MLPs and flash attention) times the layers of the
rank times the in-flight micro-batches of the schedule; communication buffers; the device's reserve.
Per-layer plans (Layout.layer_recompute, Layout.stage_layers: what llmtrain.planner.search.per_layer
searches) sum each rank's layers under their own recompute modes, so the busiest rank sets the pipeline's
pace, and size every rank's memory from its own chunks' activations under its schedule's in-flight
micro-batches.

This module holds Estimate and CostModel's evaluation (validity, per-rank costs, pipeline, memory, the step);
the terms above live in CostModel's parts: layer_time (compute, TP, CP, EP, recomputation), data_parallel
(data parallelism and the optimizer), step_collectives (the collectives a step issues), base (per-rank
shapes), memory (bytes per rank) and pipeline_time.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import asdict, dataclass, replace

from llmtrain.config.layout_rules import CHUNKED_SCHEDULES, microbatch_problem
from llmtrain.config.schema import JobConfig, ParallelConfig, TrainConfig
from llmtrain.config.validate import (
    context_parallel_problem,
    expert_layout_problem,
    layer_plan_problem,
    moe_problem,
    pipeline_problem,
    tensor_parallel_problem,
)
from llmtrain.planner.cluster.hardware import ClusterView
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.data_parallel import DataParallelTime
from llmtrain.planner.cost.layer_time import LayerTime, PassCosts
from llmtrain.planner.cost.layout import GIB, Layout, Software, Workload
from llmtrain.planner.cost.memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    edges_vocab_sharded,
    rank_memory,
    sharding_problem,
)
from llmtrain.planner.cost.pipeline_time import PipelineTime, pipeline_time
from llmtrain.planner.cost.step_collectives import StepCollectives

MAX_LINK_SHARE = 0.9
"""The largest share of the network's time the hidden data-parallel traffic takes from the EP all-to-alls
(a bound that keeps the slowdown finite when that traffic nearly fills the compute window)."""


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
    float8_gather: bool = False
    """ZeRO-3 gathers the float8 linears' weights in float8, 1 byte an element (train.fp8_all_gather)."""

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


class CostModel(LayerTime, DataParallelTime, StepCollectives):
    """Evaluates layouts of one workload on one cluster view; per-layer costs are cached across layouts."""

    def __init__(self, workload: Workload, cluster: ClusterView, software: Software | None = None) -> None:
        super().__init__(workload, cluster, software)
        self._flops = {
            rc: F.training_flops_per_token(workload.model, workload.seq, rc) for rc in F.RECOMPUTE_MODES
        }
        self._model_flops = F.model_flops_per_token(workload.model, workload.seq)
        if not workload.model.is_moe:  # torchtitan's op-level selective recomputation: its unsaved linears
            redo = sum(2.0 * n * k for n, k, _, saved in self.op_sac_linears(1) if not saved)
            self._flops["selective_op"] = self._flops["none"] + workload.model.num_layers * redo
        self._layer = functools.lru_cache(maxsize=None)(self._layer_costs)
        self._extras = functools.lru_cache(maxsize=None)(self._stage_extras)
        self._config_problem = functools.lru_cache(maxsize=None)(self._trainer_problem)

    # ------------------------------------------------------------------------------------ memory

    def activation_bytes_per_layer(self, tp: int, b: int, sp: bool, recompute: str) -> float:
        """Saved activations of one layer for one micro-batch (llmtrain.planner.cost.memory)."""
        return activation_bytes_per_layer(
            self.w.model, self.w.seq, self.act_bytes, self.sw.flash_attention, tp, b, sp, recompute,
            self.sw.fused_kernels, float8_inputs=self.prec == "fp8" and self.sw.te_fp8,
            gathered_inputs=self.gathered_inputs, op_sac_saved=self._op_sac_saved(tp, recompute),
        )  # fmt: skip

    def _op_sac_saved(self, tp: int, *modes: str) -> float:
        """Elements a token of the linear outputs torchtitan's op-level selective recomputation saves on a TP
        rank (op_sac_linears), where a layer runs it (`modes`), else 0."""
        if "selective_op" not in modes:
            return 0.0
        return sum(n for n, _, _, saved in self.op_sac_linears(tp) if saved)

    @property
    def gathered_inputs(self) -> float:
        """Bytes an element of the QKV and MLP inputs kept whole under SP (Software.tp_saves_gathered_input:
        float8 where the gather is, float8_tp), 0 where the shard is kept."""
        if not self.sw.tp_saves_gathered_input:
            return 0.0
        return 1.0 if self.float8_tp else float(self.act_bytes)

    def memory(self, layout: Layout, inflight: int, num_micro: int) -> dict[str, float]:
        """Bytes on the fullest rank (memory.rank_memory), as MemoryBreakdown.as_dict."""
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
            optimizer=self.w.optimizer,
            float8_layer=self._float8_layer(layout),
            gathered_inputs=self.gathered_inputs,
            op_sac_saved=self._op_sac_saved(layout.tp, *layout.layer_modes(self.w.model.num_layers)),
        )

    def _float8_layer(self, layout: Layout) -> float:
        """The mean layer's weight elements ZeRO-3 gathers in float8 (train.fp8_all_gather), else 0."""
        if not self.float8_gathered(layout):
            return 0.0
        return sum(weights for _, weights in self.float8_layers) / len(self.float8_layers)

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
        num_micro = w.global_batch // (layout.dp * layout.micro_batch)
        if layout.schedule in CHUNKED_SCHEDULES and layout.virtual_stages > 1 and num_micro % layout.pp:
            return f"{layout.schedule} needs the micro-batches per step to be a multiple of pp"
        return microbatch_problem(layout.schedule, layout.pp, num_micro, layout.virtual_stages)

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
        (llmtrain.config.moe_rules.expert_layout_problem: inside dp, spanning cp, or spanning tp)."""
        m, ep = self.w.model, layout.ep
        if ep == 1:
            return ""
        if not m.is_moe:
            return f"ep={ep}: model.arch={m.arch} has no experts (expert parallelism needs a MoE arch)"
        if m.num_experts % ep:
            return f"ep={ep} does not divide model.num_experts={m.num_experts}"
        parallel = ParallelConfig(tp=layout.tp, cp=layout.cp, ep=ep)
        return expert_layout_problem(parallel, layout.dp)

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

        def layer_of(mode: str) -> PassCosts:
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
            if r == layout.stage_rank(pp * v - 1):  # the output layer: the last rank, or rank 0 in a V
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
        shared = self._ep_link_sharing(layout, ep_total, dp_comm - exposed, pipe.busy)
        step = pipe.step_time + exposed + optimizer + shared

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
            ep_comm=ep_total + shared,
            float8_gather=self.float8_gathered(layout),
        )

    def _ep_link_sharing(self, layout: Layout, ep_total: float, hidden_dp: float, window: float) -> float:
        """Seconds the expert-parallel all-to-alls lose to the data-parallel (ZeRO, FSDP) traffic hidden
        behind compute, where both groups cross the nodes' network: hidden is not free there, that traffic
        still occupies the NICs over the compute window (a share hidden_dp / window of their time, at most
        MAX_LINK_SHARE), and the all-to-alls get the rest of the bandwidth."""
        if ep_total <= 0 or hidden_dp <= 0 or window <= 0:
            return 0.0
        ep_stride = self._expert_strides(layout)[0]
        if not (
            self.c.spans_nodes(layout.ep, ep_stride) and self.c.spans_nodes(layout.dp, layout.tp * layout.cp)
        ):
            return 0.0
        share = min(hidden_dp / window, MAX_LINK_SHARE)
        return ep_total * share / (1 - share)
