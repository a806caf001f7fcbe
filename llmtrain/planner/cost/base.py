"""The state every part of the cost model reads, and what a layout puts on each pipeline rank.

CostModel (llmtrain.planner.cost.model) is one class assembled from parts that each live in their own module:
LayerTime (layer_time: a layer's compute and the tensor-, context- and expert-parallel communication inside
it), StepCollectives (step_collectives: every collective a training step issues), DataParallelTime
(data_parallel: the gradient reduction, parameter gathers and optimizer step). They all derive from CostBase,
which holds the workload, the cluster view and the software, and answers the questions of shape they share:
the layers of each chunk and rank and their recompute modes, the parameters on a rank, the FSDP2 units and
the expert groups' strides.
"""

from __future__ import annotations

import itertools
from collections import Counter

from llmtrain.config.engine_rules import float8_all_gather_blocker, small_gemm
from llmtrain.planner.cluster.hardware import ClusterView
from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.layout import Layout, Software, Workload
from llmtrain.planner.cost.memory import edges_vocab_sharded, layer_parameters, stage_layers


class CostBase:
    """A workload on a cluster view under a software's behaviour, and the per-rank shapes of its layouts."""

    def __init__(self, workload: Workload, cluster: ClusterView, software: Software | None = None) -> None:
        self.w = workload
        self.c = cluster
        self.sw = software or Software()
        self.dev = cluster.device
        self.prec = workload.precision
        # Under fp8 the blocks' linear layers multiply in float8 (llmtrain.parallel.float8; linear_prec: the
        # auto filter's) and the experts' grouped GEMM as grouped_prec says: attention, the router and the
        # output layer run in bf16.
        self.bf16_prec = "bf16" if self.prec == "fp8" else self.prec
        self.act_bytes = 4 if self.prec == "fp32" else 2
        self.params = F.parameter_counts(workload.model)
        m = workload.model
        recipe, keep = workload.fp8_recipe, workload.fp8_filter
        self.float8_layers = [
            C.float8_layer_weights(m, m.is_moe_layer(i), recipe, keep) for i in range(m.num_layers)
        ]
        """Per layer, (linear layers, weight elements) that run in float8 (collectives.float8_layer_weights),
        for train.fp8_all_gather's bytes and scales."""

    @property
    def float8_filtered(self) -> bool:
        """Whether each block linear's precision depends on its shape: llmtrain's fp8 with
        train.fp8_filter=auto (Transformer Engine's recipes have no filter)."""
        return self.prec == "fp8" and not self.sw.te_fp8 and self.w.fp8_filter == "auto"

    def linear_prec(self, out_features: float, in_features: float) -> str:
        """The precision a block linear of this whole weight shape multiplies in: the workload's, except
        that where float8_filtered the shapes engine_rules.small_gemm names stay bf16, as
        llmtrain.parallel.float8 applies the filter."""
        if not self.float8_filtered:
            return self.prec
        return self.bf16_prec if small_gemm(self.w.fp8_recipe, out_features, in_features) else self.prec

    def local_linears(self, tp: int, moe: bool) -> list[tuple[float, float, str]]:
        """(out, in) features on a TP rank of one layer's block linears (collectives.float8_linear_shapes),
        each with the precision it multiplies in (linear_prec)."""
        split = {"col": (tp, 1), "row": (1, tp), "whole": (1, 1)}
        return [
            (n / split[s][0], k / split[s][1], self.linear_prec(n, k))
            for n, k, s in C.float8_linear_shapes(self.w.model, moe)
        ]

    def op_sac_linears(self, tp: int) -> list[tuple[float, float, str, bool]]:
        """(out, in features on a TP rank, precision, output saved) of a dense layer's linears in the order
        torchtitan's Llama runs them (wq, wk, wv, wo, then w1, w3, w2: the gated MLP's gate and up as two
        matmuls; up and down ungated), under its op-level selective activation checkpointing (recompute
        selective_op): its policy (torchtitan's _save_list: aten.mm, the SDPA kernels, the functional
        reduce-scatter, and under float8 the amax's max) keeps each saved op's output except every second
        aten.mm of the block's forward, counted per block, which the backward recomputes with every op
        outside the list. A float8 linear multiplies through torch._scaled_mm, which the list lacks: it is
        recomputed and not counted. Dense models only (a MoE layer's experts are grouped GEMMs)."""
        m = self.w.model
        if m.is_moe:
            raise ValueError(
                "recompute selective_op (torchtitan's op-level policy) is modelled for dense models"
            )
        linears = self.local_linears(tp, False)
        if F.is_gated(m):  # the fused gate-up as torchtitan's w1 and w3
            (n, k, prec), down = linears[-2], linears[-1]
            linears = [*linears[:-2], (n / 2, k, prec), (n / 2, k, prec), down]
        out, mms = [], 0
        for n, k, prec in linears:
            mm = prec != "fp8"
            mms += mm
            out.append((n, k, prec, mm and mms % 2 == 1))
        return out

    @property
    def float8_tp(self) -> bool:
        """Whether sequence parallelism's all-gathers carry float8 (Software.float8_tp, which torchtitan
        applies under the tensorwise recipe only: its rowwise recipes gather in bf16)."""
        return self.sw.float8_tp and self.prec == "fp8" and self.w.fp8_recipe == "tensorwise"

    def tp_layer(self, tp: int, activation: int, sp: bool, recompute: str, moe: bool = False) -> C.PassComms:
        """One layer's TP collectives (collectives.tp_layer) as this software issues them: re-gathering the
        column-parallel inputs in the backward or not (Software.tp_saves_gathered_input), the all-gathers
        in float8 or not (float8_tp)."""
        latent = self.w.model.arch == "deepseek_v3"
        gathered = activation // self.act_bytes if self.float8_tp else None
        regather = not self.sw.tp_saves_gathered_input
        return C.tp_layer(tp, activation, sp, recompute, moe, latent, regather, gathered)

    @property
    def grouped_prec(self) -> str:
        """The precision of the routed experts' grouped GEMM: fp8 under Transformer Engine's recipes, and
        under llmtrain's as train.fp8_grouped_mm resolves (llmtrain.parallel.float8_experts): rowwise or
        mxfp8, or auto on a device with a float8 rate (the Hopper and later kinds the planner knows; auto
        runs bf16 on the CPU and Ampere, which have none); else bf16."""
        if self.prec != "fp8":
            return self.prec
        mode = self.w.fp8_grouped_mm
        if self.sw.te_fp8 or mode in ("rowwise", "mxfp8"):
            return self.prec
        return self.prec if mode == "auto" and "fp8" in self.dev.peak_tflops else self.bf16_prec

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
        stages = self.chunk_layers(layout)
        return max(sum(stages[s] for s in layout.rank_stages(r)) for r in range(layout.pp))

    def chunk_layers(self, layout: Layout) -> tuple[int, ...]:
        """Layers of each model chunk: the layout's own split, else the trainer's (even or by FLOPs)."""
        chunks = layout.pp * layout.virtual_stages
        return layout.stage_layers or stage_layers(self.w.model, chunks, self.sw.balance_stages)

    def _chunk_span(self, layout: Layout, chunk: int) -> tuple[int, int]:
        """The first layer of model chunk ``chunk`` and the one after its last."""
        stages = self.chunk_layers(layout)
        start = sum(stages[:chunk])
        return start, start + stages[chunk]

    def rank_modes(self, layout: Layout) -> list[Counter[str]]:
        """Per pipeline rank, how many of its layers (over all its chunks) run each recompute mode."""
        pp, stages = layout.pp, self.chunk_layers(layout)
        if not layout.layer_recompute:
            return [
                Counter({layout.recompute: sum(stages[s] for s in layout.rank_stages(r))}) for r in range(pp)
            ]
        starts = list(itertools.accumulate(stages, initial=0))
        out: list[Counter[str]] = [Counter() for _ in range(pp)]
        for chunk, (a, n) in enumerate(zip(starts, stages, strict=False)):
            out[layout.stage_rank(chunk)].update(layout.layer_recompute[a : a + n])
        return out

    def _expert_strides(self, layout: Layout) -> tuple[int, int]:
        """The EP and expert-DP groups' strides on this cluster (collectives.expert_group_strides)."""
        return C.expert_group_strides(layout.tp, layout.cp, layout.dp, layout.ep, self.c.devices_per_node)

    def float8_gathered(self, layout: Layout) -> bool:
        """Whether ZeRO-3 gathers the float8 linears' weights in float8 (train.fp8_all_gather, as
        llmtrain.config.engine_rules.float8_all_gather decides it for a job)."""
        engine = "deepspeed" if layout.offload != "none" else "llmtrain"
        blocker = float8_all_gather_blocker(
            self.prec, self.w.fp8_recipe, layout.zero_stage, layout.tp, engine
        )
        return self.w.fp8_all_gather is not False and not blocker

    def _fsdp_units(self, layout: Layout, pp_rank: int) -> list[tuple[int, bool, bool, int]]:
        """(parameters, reshard after forward, expert, of them gathered in float8) of each FSDP2 unit of a
        rank (llmtrain.parallel.fsdp): every block (resharded at zero 3), under EP a MoE block's routed
        experts as a unit of their own on the expert-data-parallel mesh (expert true), the embedding (idem)
        and the final norm with the output layer as units of their own unless tied in one chunk, and the
        root with what is left (kept gathered). The float8 part: a block's float8 linears' weights under
        train.fp8_all_gather (collectives.float8_layer_weights), 0 elsewhere."""
        m, tp, pp, v, ep = self.w.model, layout.tp, layout.pp, layout.virtual_stages, layout.ep
        z3 = layout.zero_stage == 3
        stages = self.chunk_layers(layout)
        starts = list(itertools.accumulate(stages, initial=0))
        dense = C.rank_parameters(m, tp, 1, False, False)[0]
        moe_extra, routed, _ = C.moe_layer_parameters(m, tp, ep)
        gathered8 = self.float8_gathered(layout)

        def blocks(stage: int) -> list[tuple[int, bool, bool, int]]:
            out = []
            for i in range(starts[stage], starts[stage + 1]):
                f8 = self.float8_layers[i][1] if gathered8 else 0
                if not m.is_moe_layer(i):
                    out.append((dense, z3, False, f8))
                elif ep > 1:
                    out += [(dense + moe_extra, z3, False, f8), (routed, z3, True, 0)]
                else:
                    out.append((dense + moe_extra + routed, z3, False, f8))
            return out

        embedding = m.vocab_size // tp * m.hidden_size
        positions = m.max_positions * m.hidden_size if m.arch == "gpt" else 0
        norm = 2 * m.hidden_size if m.arch == "gpt" else m.hidden_size
        if edges_vocab_sharded(layout, m):
            # One chunk; the embedding and head are units that are never gathered, whose gradients land on
            # their shards (collectives.vocab_sharded_edges): the root keeps the final norm.
            return [*blocks(0), (norm + positions, False, False, 0)]
        units: list[tuple[int, bool, bool, int]] = []
        for stage in layout.rank_stages(pp_rank):
            first, last = stage == 0, stage == pp * v - 1
            units += blocks(stage)
            if first and last and m.tied_embeddings:
                units.append((embedding + positions + norm, False, False, 0))
                continue
            if first:
                units.append((embedding, z3, False, 0))
            if last:
                units.append((norm + embedding, False, False, 0))
            if first and positions:
                units.append((positions, False, False, 0))
        return units
