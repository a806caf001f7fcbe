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
- data parallelism: gradient all-reduce (ZeRO-0) or reduce-scatter plus parameter all-gather (ZeRO-1) over
  the DP group, overlapped with the last micro-batch's backward when the framework overlaps it; then the
  optimizer step, memory-bound over the rank's (sharded) fp32 state.
Memory per rank: weights, gradients and optimizer state per precision and ZeRO stage; activations per layer
after Korthikanti et al. 2022 (generalised to GQA, gated MLPs and flash attention) times the layers of the
rank times the in-flight micro-batches of the schedule; communication buffers; the device's reserve.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from llmtrain.config.schema import JobConfig, ModelConfig
from llmtrain.config.validate import pipeline_problem, tensor_parallel_problem
from llmtrain.planner import flops as F
from llmtrain.planner.cluster import ClusterView
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

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def short(self) -> str:
        """Compact one-line description."""
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} mb={self.micro_batch} {sched} rc={self.recompute} "
            f"sp={int(self.sequence_parallel)} zero={self.zero_stage}"
        )


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

    @classmethod
    def megatron_2021(cls) -> Software:
        """Megatron-LM as run in Narayanan et al. 2021: materialised softmax, non-overlapped fp16 gradient
        all-reduce, scatter/gather pipeline sends."""
        return cls(flash_attention=False, dp_overlap=False, p2p_scatter_gather=True, grad_bytes=2)


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
    bubble_fraction: float
    memory: dict[str, float]
    """Bytes on the fullest rank: params, grads, optimizer, activations, buffers, reserved, total."""
    capacity: float
    fits: bool
    why: str
    tflops_per_gpu: float
    """Executed FLOP/s per GPU in TFLOP/s, recomputation included (the convention of Narayanan et al.)."""
    mfu: float
    """Model FLOPs (no recomputation) per second over the GPUs' dense peak."""
    simulated: bool = False

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
            memory_breakdown_gb={k: v / GIB for k, v in self.memory.items()},
            pipeline_timing="simulator" if self.simulated else "closed-form",
        )
        return out


@dataclass(frozen=True)
class _Pass:
    """Costs of one layer (or stage extra) for one micro-batch: forward / backward / weight-grad compute and
    the TP communication inside them."""

    fwd: float
    bwd: float
    wgrad: float
    tp_fwd: float
    tp_bwd: float


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

    # ------------------------------------------------------------------------------------ compute

    def _layer_costs(self, tp: int, b: int, sp: bool, recompute: str) -> _Pass:
        m, dev, prec = self.w.model, self.dev, self.prec
        s, h, d = self.w.seq, m.hidden_size, m.head_size
        a, kv, f = m.num_attention_heads / tp, max(m.kv_heads / tp, 1), m.ffn_size / tp
        tok = b * s
        up = 2 * f if F.is_gated(m) else f
        gemms = (
            dev.gemm_time(tok, (a + 2 * kv) * d, h, prec)
            + dev.gemm_time(tok, h, a * d, prec)
            + dev.gemm_time(tok, up, h, prec)
            + dev.gemm_time(tok, h, f, prec)
        )
        # Weight-gradient matmuls have the same sizes as the forward's (dW = X^T dY).
        wgrad = gemms
        e = self.act_bytes
        if self.sw.flash_attention:
            core_flops = 4.0 * tok * s * a * d
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
        act = (6 if F.is_gated(m) else 4) * e * tok * f
        rotary = 0 if m.arch == "gpt" else 2 * e * tok * (a + kv) * d
        elem = dev.memory_time(2 * 2 * e * nh + 2 * (3 * e + dropout) * nh + act + rotary, kernels=6)
        fwd = gemms + core_f + elem
        bwd = 2 * gemms + core_b + 2 * elem
        if recompute == "full":
            bwd += fwd
        elif recompute == "selective":
            bwd += core_f
        # Tensor-parallel collectives on the b*s*h activation, 2 per pass (attention and MLP outputs).
        size = e * tok * h
        if tp > 1:
            one = (
                self.c.all_gather(size, tp) + self.c.reduce_scatter(size, tp)
                if sp
                else self.c.all_reduce(size, tp)
            )
            tp_f, tp_b = 2 * one, 2 * one
            if recompute == "full":
                tp_b += tp_f
        else:
            tp_f = tp_b = 0.0
        return _Pass(fwd, bwd, wgrad, tp_f, tp_b)

    def _stage_extras(self, tp: int, b: int, sp: bool) -> tuple[_Pass, _Pass]:
        """(first stage: embedding, last stage: final norm, logits and cross-entropy) per micro-batch."""
        m, dev, prec, e = self.w.model, self.dev, self.prec, self.act_bytes
        tok, h, vocab = b * self.w.seq, m.hidden_size, m.vocab_size / tp
        size = e * tok * h
        emb_f = dev.memory_time(2 * e * tok * h, kernels=2)
        emb_tp = (self.c.reduce_scatter(size, tp) if sp else self.c.all_reduce(size, tp)) if tp > 1 else 0.0
        first = _Pass(emb_f, 2 * emb_f, emb_f, emb_tp, 0.0)
        logits = dev.gemm_time(tok, vocab, h, prec)
        ce = dev.memory_time(3 * 4 * tok * vocab, kernels=3)  # fp32 softmax, loss and its gradient
        norm = dev.memory_time(2 * e * tok * h / (tp if sp else 1))
        head_tp = (self.c.all_gather(size, tp) if sp else 0.0) if tp > 1 else 0.0
        head_tp_b = (
            (self.c.reduce_scatter(size, tp) if sp else self.c.all_reduce(size, tp)) if tp > 1 else 0.0
        )
        last = _Pass(logits + ce / 3 + norm, 2 * logits + 2 * ce / 3 + 2 * norm, logits, head_tp, head_tp_b)
        return first, last

    # ------------------------------------------------------------------------------------ memory

    def activation_bytes_per_layer(self, tp: int, b: int, sp: bool, recompute: str) -> float:
        """Saved activations of one layer for one micro-batch (Korthikanti et al. 2022, generalised)."""
        m, e = self.w.model, self.act_bytes
        s, h, d = self.w.seq, m.hidden_size, m.head_size
        sbh = s * b * h
        if recompute == "full":
            return e * sbh / (tp if sp else 1)  # the layer's input only
        a, kv, f = m.num_attention_heads, m.kv_heads, m.ffn_size
        kv_local = max(kv / tp, 1) * tp  # kv heads are replicated when tp exceeds them
        hidden_mask = 1 if m.hidden_dropout > 0 else 0
        # Replicated over TP unless SP: 2 norm inputs, QKV input, MLP input, 2 dropout masks.
        replicated = (4 * e + hidden_mask * 2) * sbh
        # Split over TP: Q, K, V, attention output (out-proj input), MLP intermediates.
        mlp = (2 * f * e + f * e) if F.is_gated(m) else 2 * f * e  # gated: gate+up output and swiglu output
        split = s * b * ((a + 2 * kv_local) * d * e + a * d * e + mlp)
        if not self.sw.flash_attention and recompute != "selective":
            drop = m.attention_dropout > 0
            split += (
                a * s * s * b * (e + (1 + e if drop else 0))
            )  # softmax output (+ dropout mask and output)
        return replicated / (tp if sp else 1) + split / tp

    def _params_on_rank(self, layout: Layout) -> tuple[float, float]:
        """Parameters on the first and on the last pipeline rank (per TP shard)."""
        p, tp = self.params, layout.tp
        layers = self._max_layers_per_rank(layout)
        body = layers * p.per_layer / tp
        if layout.pp == 1:
            return body + (p.embedding + p.head + p.final_norm) / tp, body
        head = (
            p.head or self.w.model.vocab_size * self.w.model.hidden_size
        ) / tp  # tied: a copy on the last stage
        return body + p.embedding / tp, body + head + p.final_norm

    def _max_layers_per_rank(self, layout: Layout) -> int:
        chunks = layout.pp * layout.virtual_stages
        return -(-self.w.model.num_layers // chunks) * layout.virtual_stages

    def memory(self, layout: Layout, inflight: int, num_micro: int) -> dict[str, float]:
        """Bytes on the fullest rank (the first pipeline rank, or the last when its head dominates)."""
        e, g = self.act_bytes, self.sw.grad_bytes
        opt = (
            8 if self.prec == "fp32" else 12
        )  # Adam m and v (+ fp32 master weights when training in 16 bits)
        shard = layout.dp if layout.zero_stage >= 1 else 1
        first_p, last_p = self._params_on_rank(layout)
        layers_chunk = -(-self.w.model.num_layers // (layout.pp * layout.virtual_stages))
        per_layer = self.activation_bytes_per_layer(
            layout.tp, layout.micro_batch, layout.sequence_parallel, layout.recompute
        )
        tok = layout.micro_batch * self.w.seq
        sp_div = layout.tp if layout.sequence_parallel else 1
        act_first = (
            inflight * layers_chunk * per_layer + inflight * e * tok * self.w.model.hidden_size / sp_div
        )
        # Last rank: its own micro-batches (1f1b: 1 per chunk) plus one micro-batch of logits in fp32.
        logits = tok * self.w.model.vocab_size / layout.tp * (e + 4)
        last_inflight = min(num_micro * layout.virtual_stages, layout.virtual_stages)
        act_last = last_inflight * layers_chunk * per_layer + logits
        if layout.pp == 1:
            act_first, act_last = act_first + logits, 0.0
        send = e * tok * self.w.model.hidden_size / sp_div
        buffers = (
            2 * send
            + 2 * self.w.dp_bucket_mb * 2**20
            + (e * tok * self.w.model.hidden_size if layout.sequence_parallel else 0)
        )

        def total(params: float, act: float) -> dict[str, float]:
            out = {
                "params": params * e,
                "grads": params * g,
                "optimizer": params * opt / shard,
                "activations": act,
                "buffers": buffers,
                "reserved": self.dev.reserved_gb * GIB,
            }
            out["total"] = sum(out.values())
            return out

        a, b = total(first_p, act_first), total(last_p, act_last)
        return a if a["total"] >= b["total"] else b

    # ------------------------------------------------------------------------------------ evaluate

    def invalid_reason(self, layout: Layout) -> str:
        """Why a layout cannot run or is not worth evaluating (empty if neither): the model's TP and pipeline
        rules (llmtrain.config.validate, as a training run checks them), then the batch and the planner's
        own restrictions."""
        m, w = self.w.model, self.w
        if layout.gpus != self.c.devices:
            return f"tp*pp*dp={layout.gpus} != {self.c.devices} GPUs"
        model_rule = tensor_parallel_problem(m, layout.tp, layout.sequence_parallel) or pipeline_problem(
            m.num_layers, layout.pp, layout.virtual_stages, layout.schedule
        )
        if model_rule:
            return model_rule
        if w.global_batch % (layout.dp * layout.micro_batch):
            mbdp = layout.micro_batch * layout.dp
            return f"global batch {w.global_batch} not a multiple of micro_batch*dp={mbdp}"
        if layout.sequence_parallel and layout.tp == 1:
            return "sequence parallelism without tp > 1 changes nothing (use sequence_parallel=false)"
        if layout.zero_stage and layout.dp == 1:
            return "ZeRO needs dp > 1"
        if layout.pp == 1 and layout.schedule != "1f1b":
            return "pp=1 runs no pipeline schedule (use 1f1b)"
        if (
            layout.schedule == "interleaved_1f1b"
            and (w.global_batch // (layout.dp * layout.micro_batch)) % layout.pp
        ):
            return "interleaved_1f1b needs the micro-batches per step to be a multiple of pp"
        return ""

    def evaluate(self, layout: Layout, use_simulator: bool = False) -> Estimate:
        """Predicted step time, breakdown and memory of `layout` (raises ValueError if it cannot run)."""
        why = self.invalid_reason(layout)
        if why:
            raise ValueError(f"layout {layout.short()} is invalid: {why}")
        tp, pp, v, b = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batch
        num_micro = self.w.global_batch // (layout.dp * b)
        layer = self._layer(tp, b, layout.sequence_parallel, layout.recompute)
        first, last = self._extras(tp, b, layout.sequence_parallel)
        chunks = pp * v
        layers_total = self.w.model.num_layers
        # Per-rank per-chunk costs; uneven splits give the first chunks one more layer.
        fwd, bwd, wgt, tpc = [], [], [], []
        for r in range(pp):
            n = (
                sum(
                    layers_total // chunks + (1 if c * pp + r < layers_total % chunks else 0)
                    for c in range(v)
                )
                / v
            )
            f = n * (layer.fwd + layer.tp_fwd)
            bk = n * (layer.bwd + layer.tp_bwd)
            wg = n * layer.wgrad
            tcomm = n * (layer.tp_fwd + layer.tp_bwd)
            if r == 0:
                f += (first.fwd + first.tp_fwd) / v
                bk += (first.bwd + first.tp_bwd) / v
                tcomm += (first.tp_fwd + first.tp_bwd) / v
            if r == pp - 1:
                f += (last.fwd + last.tp_fwd) / v
                bk += (last.bwd + last.tp_bwd) / v
                wg += last.wgrad / v
                tcomm += (last.tp_fwd + last.tp_bwd) / v
            fwd.append(f)
            bwd.append(bk)
            wgt.append(min(wg, bk))
            tpc.append(tcomm)
        send = self.act_bytes * b * self.w.seq * self.w.model.hidden_size
        split = layout.sequence_parallel or self.sw.p2p_scatter_gather
        cross = self.c.spans_nodes(pp, tp * layout.dp)
        p2p = self.c.p2p(send / (tp if split else 1), cross) if pp > 1 else 0.0
        if split and not layout.sequence_parallel and tp > 1 and pp > 1:
            p2p += self.c.all_gather(send, tp)  # scatter/gather re-assembles the activation over NVLink
        pipe: PipelineTime = pipeline_time(
            layout.schedule, pp, num_micro, v, fwd, bwd, wgt, p2p, use_simulator
        )

        busiest = max(range(pp), key=lambda r: fwd[r] + bwd[r])
        tp_total = num_micro * v * tpc[busiest]
        compute = pipe.busy - tp_total

        # Data parallelism: gradients of the rank's parameters (the larger of first/last rank).
        params_rank = max(self._params_on_rank(layout))
        dp, stride = layout.dp, tp
        if layout.zero_stage >= 1:
            reduce = self.c.reduce_scatter(params_rank * self.sw.grad_bytes, dp, stride)
            gather = self.c.all_gather(params_rank * self.act_bytes, dp, stride)
        else:
            reduce, gather = self.c.all_reduce(params_rank * self.sw.grad_bytes, dp, stride), 0.0
        if self.sw.dp_overlap and dp > 1:
            window = bwd[0] * v  # the last micro-batch's backward on the first rank
            bucket = self.w.dp_bucket_mb * 2**20 / max(params_rank * self.sw.grad_bytes, 1.0)
            exposed = max(reduce - window, reduce * min(bucket, 1.0)) + gather
        else:
            exposed = reduce + gather
        local = params_rank / (dp if layout.zero_stage >= 1 else 1)
        # Adam: read grad, master, m, v; write master, m, v, the 16-bit weights; plus the norm over grads.
        optimizer = self.dev.memory_time(local * (self.sw.grad_bytes * 2 + 4 * 6 + self.act_bytes), kernels=4)
        step = pipe.step_time + exposed + optimizer

        mem = self.memory(layout, pipe.peak_inflight, num_micro)
        capacity = self.dev.memory_gb * GIB
        fits = mem["total"] <= capacity
        why = ""
        if not fits:
            top = max(("params", "grads", "optimizer", "activations"), key=lambda k: mem[k])
            why = (
                f"needs {mem['total'] / GIB:.1f} GiB > {self.dev.memory_gb:g} GiB "
                f"(largest: {top} {mem[top] / GIB:.1f} GiB)"
            )
        tokens = self.w.global_batch * self.w.seq
        executed = self._flops[layout.recompute] * tokens
        model_flops = self._model_flops * tokens
        gpus = layout.gpus
        return Estimate(
            layout=layout,
            step_time=step,
            compute=compute,
            tp_comm=tp_total,
            pp_bubble=pipe.step_time - pipe.busy,
            dp_comm=reduce + gather,
            dp_exposed=exposed,
            optimizer=optimizer,
            bubble_fraction=pipe.bubble_fraction,
            memory=mem,
            capacity=capacity,
            fits=fits,
            why=why,
            tflops_per_gpu=executed / step / gpus / 1e12,
            mfu=model_flops / step / gpus / self.dev.peak_flops(self.prec),
            simulated=pipe.simulated,
        )


def with_layout(job: JobConfig, layout: Layout, global_batch: int | None = None) -> JobConfig:
    """A copy of `job` running `layout` (and `global_batch` if given): what --write produces."""
    model = replace(job.model, recompute=layout.recompute)
    parallel = replace(
        job.parallel,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        virtual_stages=layout.virtual_stages,
        schedule=layout.schedule,
        sequence_parallel=layout.sequence_parallel,
        zero_stage=layout.zero_stage,
        auto=False,
    )
    train = replace(
        job.train,
        micro_batch_size=layout.micro_batch,
        global_batch_size=global_batch or job.train.global_batch_size,
    )
    return replace(job, model=model, parallel=parallel, train=train)
