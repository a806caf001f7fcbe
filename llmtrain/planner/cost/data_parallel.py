"""Data-parallel time of a step: the gradient reduction and parameter gathers (ZeRO 0-3, hybrid sharding,
offload) with the part the backward does not hide, the optimizer step, and the gradients' accumulation into
the fp32 buffer.
"""

from __future__ import annotations

from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost.base import CostBase
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.cost.memory import expert_dp_size, expert_shard_group, layer_parameters, shard_group

NS_STEPS = 5
"""Newton-Schulz iterations the time model counts for Muon (train.muon_ns_steps' default)."""


class DataParallelTime(CostBase):
    """Seconds of the data-parallel communication, the optimizer step and the gradient accumulation."""

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
        gather. Under train.fp8_all_gather the step's all-reduce of the float8 weights' scales is added.
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
                (n, 2 if reshard else 1, (xshard, xstride) if expert else (shard, tp), f8)
                for n, reshard, expert, f8 in self._fsdp_units(layout, 0)
            ]
            reduce = sum(self.c.reduce_scatter(n * g, *where) for n, _, where, _ in units)
            # Per gather round (a micro-batch's forward, at zero 3 also its backward), as `gathers` counts;
            # train.fp8_all_gather's float8 weights at 1 byte an element.
            gather = sum(k * self.c.all_gather((n - f8) * e + f8, *where) for n, k, where, f8 in units)
            gather /= 2 if z == 3 else 1
            calls = sum((reductions + num_micro * k) * (where[0] > 1) for _, k, where, _ in units)
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
        if z >= 2 and dp > 1 and self.float8_gathered(layout):
            # train.fp8_all_gather's scales after the step: one fp32 all-reduce (MAX) of the rank's float8
            # weights' amaxes over the shard group (float8_gather.precompute_weight_scales), not overlapped.
            linears = self._max_layers_per_rank(layout) * max(n for n, _ in self.float8_layers)
            scales = self.c.all_reduce(linears * C.FLOAT8_SCALE_BYTES, shard, tp)
            reduce, exposed = reduce + scales, exposed + scales
        if self.w.optimizer == "muon":
            muon_comm, ns = self._muon_time(layout)
            reduce, exposed, optimizer = reduce + muon_comm, exposed + muon_comm, optimizer + ns
        return reduce + gather, exposed, optimizer

    def _muon_time(self, layout: Layout) -> tuple[float, float]:
        """(all-reduce, Newton-Schulz) seconds of train.optimizer=muon's step on the fullest rank
        (llmtrain.parallel.muon): the stage's matrices assembled whole in fp32 by one all-reduce over its
        tp x cp x dp ranks, never overlapped (it sits inside the optimizer step); then NS_STEPS Newton-Schulz
        iterations of three bf16 matmuls each, taken as square matrices of the hidden size (X X^T, A A and
        B X), over the matrices the rank holds a piece of: all of them under TP and ZeRO-2/3 (every rank
        holds a piece of each), about 1/dp of them under ZeRO-1 (each DP rank owns its flat range)."""
        m, tp = self.w.model, layout.tp
        body = self._max_layers_per_rank(layout) * layer_parameters(m, tp, layout.ep)[0]
        experts = self._expert_params_on_rank(layout)
        whole = body * tp + experts * layout.ep
        ranks = tp * layout.cp * layout.dp
        comm = self.c.all_reduce(4 * whole, ranks, 1)
        computed = whole / (shard_group(layout) if layout.zero_stage == 1 else 1)
        h = m.hidden_size
        ns = self.dev.gemm_time(h, h, h, "bf16", batch=3 * NS_STEPS * computed / (h * h))
        return comm, ns

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
