"""Every collective and send one training step issues on a rank, with how often: CostModel.collectives, what
tests/planner/test_collectives.py compares with the trainer's traced step.
"""

from __future__ import annotations

import itertools
from collections import Counter

from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.base import CostBase
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.cost.memory import edges_vocab_sharded, expert_dp_size


class StepCollectives(CostBase):
    """The collectives of one step (the count; their time is LayerTime's and DataParallelTime's)."""

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
        and the gradient norm is summed over the world. With train.optimizer=muon the step adds the
        all-reduce that assembles the stage's Muon matrices whole (collectives.muon_layer_parameters)."""
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
        muon = 0  # the elements of the Muon matrices of this rank's stages, whole
        starts = list(itertools.accumulate(stages, initial=0))
        heads, kv = m.num_attention_heads // tp, max(m.kv_heads // tp, 1)
        numel = replicated = partial = kv_replicated = 0
        ep = layout.ep
        moe_extra, routed, moe_partial = C.moe_layer_parameters(m, tp, ep)
        experts = 0
        emb, head = C.edge_layers(tp, sp, dp if edges_vocab_sharded(layout, m) else 1, activation, tok)
        for stage in layout.rank_stages(pp_rank):
            first, last = stage == 0, stage == pp * v - 1
            layers = range(starts[stage], starts[stage + 1])
            for (mode, moe), n in Counter((modes[i], m.is_moe_layer(i)) for i in layers).items():
                layer = self.tp_layer(tp, activation, sp, mode, moe)
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
            muon += sum(C.muon_layer_parameters(m, m.is_moe_layer(i)) for i in layers)
            if first:
                add(emb.fwd + emb.bwd, num_micro)
            if last:
                add(head.fwd + head.bwd + C.cp_loss(cp).fwd, num_micro)
            # Transfers to the neighbouring stages on other ranks (the bottom of a V hands over locally).
            remote = [
                n for n in (stage - 1, stage + 1) if 0 <= n < pp * v and layout.stage_rank(n) != pp_rank
            ]
            sends = num_micro * len(remote)
            if sends:
                out[C.Comm("send", "pp", 2, activation // (tp if sp else 1))] += sends
            n, r = C.rank_parameters(m, tp, stages[stage], first, last)
            partial += F.attention_whole_parameters(m) * stages[stage] if tp > 1 else 0
            kv_replicated += C.kv_replica_parameters(m, tp) * stages[stage]
            numel, replicated = numel + n, replicated + r
        if pp > 1:
            out[C.Comm("broadcast", "pp", pp, 4)] += 1  # the mean loss, from the last stage
            last_rank = layout.stage_rank(pp * v - 1)  # rank 0 in a V: one tied parameter, no pair
            tied = m.tied_embeddings and last_rank != 0 and pp_rank in (0, last_rank)
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
        muon_ranks = tp * cp * dp
        if self.w.optimizer == "muon" and muon_ranks > 1:
            # Muon assembles the stage's matrices whole by one fp32 all-reduce over its tp x cp x dp ranks
            # (llmtrain.parallel.muon), each rank writing the pieces it owns into a zeroed buffer.
            out[C.Comm("all_reduce", C.group_name(("tp", "cp", "dp"), sizes), muon_ranks, 4 * muon)] += 1
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
        the dimensions in which each peer differs. Under train.fp8_all_gather a block's float8 linears'
        weights travel as 1 byte an element, and each step all-reduces (MAX) the amaxes of the rank's
        float8 weights in one fp32 collective (llmtrain.parallel.float8_gather)."""
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
            units = self._fsdp_units(layout, pp_rank)
            pieces = [
                (
                    (unit - f8) * e + f8,
                    unit * 4,
                    num_micro * (2 if reshard else 1),
                    layout.reductions(num_micro),
                    expert,
                )
                for unit, reshard, expert, f8 in units
            ]
        out: Counter[C.Comm] = Counter()
        if layout.zero_stage >= 2 and self.float8_gathered(layout) and dp > 1:
            linears = sum(
                self.float8_layers[i][0]
                for stage in layout.rank_stages(pp_rank)
                for i in range(*self._chunk_span(layout, stage))
            )
            out[C.Comm("all_reduce", group, dp, linears * C.FLOAT8_SCALE_BYTES)] += 1
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
