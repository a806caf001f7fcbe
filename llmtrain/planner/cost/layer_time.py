"""Per layer and micro-batch: compute, and the tensor-, context- and expert-parallel communication inside it.

How each term is counted is the overview in llmtrain.planner.cost.model (compute, tensor parallelism,
recomputation, context parallelism, mixture of experts, latent attention); the per-layer costs come out as
PassCosts, which CostModel caches per shape and sums per pipeline rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost import host_ops as H
from llmtrain.planner.cost.base import CostBase
from llmtrain.planner.cost.layout import Layout


def micro_pipelined(comm: float, gemms: float, tp: int) -> float:
    """Exposed seconds of `comm` seconds of TP collectives run micro-pipelined with the `gemms` seconds of
    matmuls they feed or are fed by (Software.async_tp: torch's symmetric-memory fused all-gather-matmul
    consumes the local shard while the next is copied from a peer, then each arriving shard; its fused
    matmul-reduce-scatter sends each chunk's partial result while the next chunk is computed). The tensor
    moves in tp chunks of comm / tp; tp - 1 of them overlap a chunk of the matmul (gemms / tp) and show only
    what outlasts it, and one, the pipeline's ramp (the last partial result's transfer, which no matmul is
    left to cover), stays exposed: comm / tp + (tp - 1) / tp * max(0, comm - gemms), between one chunk and
    comm itself (no matmul to hide behind)."""
    return comm / tp + (tp - 1) / tp * max(0.0, comm - gemms)


@dataclass(frozen=True)
class PassCosts:
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


class LayerTime(CostBase):
    """Seconds of one layer's (and a stage's extra layers') forward and backward on one rank."""

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
    ) -> PassCosts:
        """One mean layer's costs for a micro-batch of `b` sequences; `dp` places the EP group (ep > 1)."""
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
        if self.float8_filtered:  # each projection at its own precision
            attn = sum(dev.gemm_time(tok, n, k, p) for n, k, p in self.local_linears(tp, False)[:-2])
        gemms = attn + mlp_gemms
        # Weight-gradient matmuls have the same sizes as the forward's (dW = X^T dY).
        wgrad = gemms
        e = self.act_bytes
        ring = cp > 1 and cp_comm == "ring" and not self.sw.fused_ring_attention
        if ring:
            core_f, core_b = self._ring_core(tp, b, cp)
        elif self.sw.flash_attention or cp > 1:
            # Fused kernels (all_to_all, or each ring step's block pairs as flash attention): the same FLOPs.
            # The rank's queries against all keys (all_to_all: all tokens of a/cp heads): a cp-th of it.
            core_flops = 4.0 * tok * s * a * width * (0.5 if self.sw.causal_skip else 1.0)
            core_f = dev.attention_time(core_flops, self.bf16_prec)
            # flash backward recomputes QK^T: 5 matmuls
            core_b = 2.5 * dev.attention_time(core_flops, self.bf16_prec)
        else:
            scores = b * a * s * s
            # Fused scale-mask-softmax reads and writes the scores once; dropout adds a read, write and mask.
            softmax = scores * (2 * e + (2 * e + 1 if m.attention_dropout > 0 else 0))
            core_f = dev.gemm_time(s, s, d, self.bf16_prec, batch=b * a)
            core_f += dev.gemm_time(s, d, s, self.bf16_prec, batch=b * a)
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
        if prec == "fp8":
            cast_f, cast_b = self._float8_cast_bytes(tp, tok, ep)
            elem += dev.memory_time(cast_f, kernels=4)
            elem_b += dev.memory_time(cast_b, kernels=8)
        fwd = gemms + core_f + elem
        bwd = 2 * gemms + core_b + elem_b
        if recompute == "full":
            bwd += fwd
        elif recompute == "selective":
            bwd += core_f
        elif recompute == "selective_op":
            # torchtitan's op-level policy (CostBase.op_sac_linears): the linears it does not save, and every
            # memory-bound forward op (norms, rotary, activation, residual adds, casts); attention is saved.
            redo = [dev.gemm_time(tok, n, k, p) for n, k, p, saved in self.op_sac_linears(tp) if not saved]
            bwd += sum(redo) + elem
        # Tensor-parallel collectives on the b*s*h activation, as the trainer issues them (collectives.py),
        # the dense and the MoE layers' averaged; a MoE layer's router statistics summed over TP and CP.
        share = F.moe_layer_count(m) / m.num_layers
        comms = self.tp_layer(tp, e * tok * h, sp, recompute)
        moe = self.tp_layer(tp, e * tok * h, sp, recompute, True)
        stats = C.router_stats(m.num_experts, tp, cp, recompute)
        tp_f = (1 - share) * self._comm_time(comms.fwd) + share * self._comm_time(moe.fwd)
        tp_b = (1 - share) * self._comm_time(comms.bwd) + share * self._comm_time(moe.bwd)
        if self.sw.tp_comm_overlap:  # hidden behind the pass's GEMMs (backward: input- and weight-gradient)
            tp_f, tp_b = max(0.0, tp_f - gemms), max(0.0, tp_b - 2 * gemms)
        elif self.sw.async_tp and sp:
            # The backward's GEMMs: input- and weight-gradient, and the forward's again under full recompute.
            bwd_gemms = (3 if recompute == "full" else 2) * gemms
            tp_f, tp_b = micro_pipelined(tp_f, gemms, tp), micro_pipelined(tp_b, bwd_gemms, tp)
        tp_f += share * self._router_stats_time(stats.fwd, "tp", tp)
        tp_b += share * self._router_stats_time(stats.bwd, "tp", tp)
        ops_f, ops_b = H.layer_ops(m, comms, recompute)
        fwd, bwd = self._with_host(fwd, ops_f), self._with_host(bwd, ops_b)
        cp_f, cp_b = self._cp_exposed(tp, tok, cp, cp_comm, recompute, core_f, core_b)
        cp_f += share * self._router_stats_time(stats.fwd, "cp", tp)
        cp_b += share * self._router_stats_time(stats.bwd, "cp", tp)
        # Full recomputation replays the forward's dispatch and combine in the backward (collectives.ep_layer)
        # as it replays the forward's TP and CP collectives above.
        ep_f = self._ep_time(tp, tok, cp, ep, dp)
        ep_b = 2 * ep_f if recompute == "full" else ep_f
        return PassCosts(fwd, bwd, wgrad, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b)

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
        m, dev, e = self.w.model, self.dev, self.act_bytes
        h, f = m.hidden_size, m.ffn_size / tp
        gated = F.is_gated(m)
        up, down = self.local_linears(tp, False)[-2:]
        dense = sum(dev.gemm_time(tok, n, k, p) for n, k, p in (up, down))
        dense_bytes = (6 if gated else 4) * e * tok * f
        moe_layers = F.moe_layer_count(m)
        if not moe_layers:
            return dense, dense_bytes
        fe, local, routing = m.expert_ffn_size, m.num_experts // ep, tok // tp
        rows = C.routed_rows(tok, m.num_experts_per_tok, tp) * self.sw.moe_imbalance
        per_expert = rows / local
        # The experts' grouped GEMM in FP8 where train.fp8_grouped_mm runs it (grouped_prec; Transformer
        # Engine's always); the router in bf16 under both.
        grouped, router = self.grouped_prec, self.bf16_prec
        routed = local * (
            dev.gemm_time(per_expert, 2 * fe, h, grouped) + dev.gemm_time(per_expert, h, fe, grouped)
        )
        shared_f = fe * m.num_shared_experts
        shared = 0.0
        if shared_f:
            shared = sum(dev.gemm_time(routing, n, k, p) for n, k, p in self.local_linears(tp, True)[-2:])
        moe = dev.gemm_time(routing, m.num_experts, h, router) + routed + shared
        # Per routed row of h: gather (read, write), concatenate (read, write), cast up (read e, write 4),
        # weight (read 4, write 4), cast down (read 4, write e), index-add (read, write).
        # Fused permute and unpermute (Software.fused_moe_permute): a read and a write of each row each way.
        per_row = 4 * e if self.sw.fused_moe_permute else 8 * e + 16
        moe_bytes = 6 * e * (rows * fe + routing * shared_f) + per_row * rows * h
        share = moe_layers / m.num_layers
        return (1 - share) * dense + share * moe, (1 - share) * dense_bytes + share * moe_bytes

    def _float8_cast_bytes(self, tp: int, tok: int, ep: int = 1) -> tuple[float, float]:
        """(forward, backward) bytes of one layer's float8 casts (llmtrain.parallel.gemms): each cast reads
        its bf16 operand for the amax, then reads it again and writes e4m3/e5m2, 5 bytes an element. A
        linear layer casts its input and weight forward; backward the output gradient twice (input- and
        weight-gradient GEMMs), the weight and the input again. The rank's linears (in, out features), of a
        dense and a MoE layer averaged (whose shared experts see the 1/tp of the tokens the rank routes);
        with train.fp8_filter=auto only those that run in float8 (linear_prec). Where the routed experts'
        grouped GEMM runs in float8 (grouped_prec, torchao's), its routed rows and the rank's E/ep experts'
        weights are cast the same way.

        Software.te_fp8 (Transformer Engine): a cast-transpose reads the bf16 operand once and writes its
        float8 copy and the copy's transpose, 4 bytes an element, with the amax taken in the same pass; the
        input forward and the output gradient backward are cast once each, the saved float8 input serves the
        weight-gradient GEMM, and the weights' casts (once per step, cached across micro-batches) are left
        out; the routed experts' rows are cast too (their grouped GEMM runs in FP8).

        Software.compiled_float8 (torchao's tensorwise scaling under torch.compile, the bytes of torchao's
        roofline model with fusion): an activation's amax is reduced in the kernel that produces it (no
        bytes), and its cast reads 2 bytes an element and writes 1 in each of two layouts, 4 bytes, once: the
        input forward, its float8 copy saved for the weight-gradient GEMM, and the output gradient backward; a
        weight's amax reads it (2 bytes) and each of its two casts, forward and backward, reads 2 and writes
        1: forward 4 t i + 5 i o, backward 4 t o + 3 i o a linear, against 5 (t i + i o) and
        5 (2 t o + i o + t i) eager."""
        m = self.w.model
        h, d = m.hidden_size, m.head_size
        a, kv = m.num_attention_heads / tp, max(m.kv_heads / tp, 1)
        if m.arch == "deepseek_v3":
            down = F.latent_down_projection_params(m)
            up = (F.latent_projection_params(m) - down) / (tp * h)
            attn = [(h, up), (h, down / h), (a * m.v_head_dim, h)]
        else:
            attn = [(h, a * d), (h, kv * d), (h, kv * d), (a * d, h)]
        width = 2 if F.is_gated(m) else 1
        dense = [(h, width * m.ffn_size / tp), (m.ffn_size / tp, h)]
        shared_f = m.expert_ffn_size * m.num_shared_experts if m.is_moe else 0
        shared = [(h, 2 * shared_f), (shared_f, h)] if shared_f else []

        compiled = self.sw.compiled_float8 and self.w.fp8_recipe == "tensorwise"

        def passes(linears: list[tuple[float, float]], t: float, fused: bool = False) -> tuple[float, float]:
            if self.sw.te_fp8:
                return 4 * sum(t * i for i, _ in linears), 4 * sum(t * o for _, o in linears)
            if fused:
                fwd = sum(4 * t * i + 5 * i * o for i, o in linears)
                return fwd, sum(4 * t * o + 3 * i * o for i, o in linears)
            fwd = sum(t * i + i * o for i, o in linears)
            bwd = sum(2 * t * o + i * o + t * i for i, o in linears)
            return 5 * fwd, 5 * bwd

        if self.float8_filtered:  # only the linears that run in float8
            block = self.local_linears(tp, False)
            attn = [(k, n) for n, k, p in block[:-2] if p == "fp8"]
            dense = [(k, n) for n, k, p in block[-2:] if p == "fp8"]
            shared = [(k, n) for n, k, p in self.local_linears(tp, True)[-2:] if p == "fp8"] if shared else []
        share = F.moe_layer_count(m) / m.num_layers
        # The routed experts' grouped GEMMs (rowwise or MX scaling) keep the eager count below.
        attn_f, attn_b = passes(attn, tok, compiled)
        dense_f, dense_b = passes(dense, tok, compiled)
        moe_f, moe_b = passes(shared, tok / tp, compiled)
        if share and self.grouped_prec == "fp8":
            # The routed rows' casts, and (llmtrain's torchao grouped GEMMs) each local expert's weights.
            fe, local = m.expert_ffn_size, m.num_experts // ep
            rows = C.routed_rows(tok, m.num_experts_per_tok, tp) * self.sw.moe_imbalance
            routed_f, routed_b = passes([(h, 2 * fe), (fe, h)], rows)
            if not self.sw.te_fp8:
                weights = 5 * (local - 1) * 3 * h * fe  # passes counted one expert's weights
                routed_f, routed_b = routed_f + weights, routed_b + weights
            moe_f, moe_b = moe_f + routed_f, moe_b + routed_b
        return (
            attn_f + (1 - share) * dense_f + share * moe_f,
            attn_b + (1 - share) * dense_b + share * moe_b,
        )

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

    def _stage_extras(
        self, tp: int, b: int, sp: bool, cp: int = 1, vocab_dp: int = 1
    ) -> tuple[PassCosts, PassCosts]:
        """(first stage: embedding, last stage: final norm, logits and cross-entropy) per micro-batch;
        `vocab_dp` > 1: the edges vocabulary-sharded over that many ZeRO ranks (the same FLOPs per rank, the
        group's tokens against its share of the vocabulary, plus collectives.vocab_sharded_edges)."""
        m, dev, e = self.w.model, self.dev, self.act_bytes
        tok, h, vocab = b * self.w.seq // cp, m.hidden_size, m.vocab_size / tp
        size = e * tok * h
        # Device.memory_table times the reference path's operators: the fused kernels (a GPU's) keep the
        # bandwidth model, whose terms are a few percent of a GPU layer's time.
        measured = 0.0 if self.sw.fused_kernels else 1.0
        emb_f = dev.memory_time(2 * e * tok * h, kernels=2, tensor_bytes=measured * size)
        emb, head = C.edge_layers(tp, sp, vocab_dp, size, tok)
        first = PassCosts(emb_f, 2 * emb_f, emb_f, self._comm_time(emb.fwd), self._comm_time(emb.bwd))
        # The logits are the one output large enough to come fresh from the system on a CPU (the gradient
        # ones the cross-entropy writes are in its measured rate); a GPU's allocator reuses its blocks.
        logits = dev.gemm_time(tok, vocab, h, self.bf16_prec)  # the output layer stays bf16 under fp8
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
        last = PassCosts(last_f, last_b, logits, head_tp, head_tp_b)
        return first, last

    def _comm_time(self, comms: tuple[C.Comm, ...]) -> float:
        """Seconds for TP collectives issued one after another (the group's ranks are adjacent: stride 1)."""
        cost = {"all_reduce": self.c.all_reduce, "all_gather": self.c.all_gather}
        return sum(cost.get(c.op, self.c.reduce_scatter)(c.nbytes, c.size) for c in comms)
