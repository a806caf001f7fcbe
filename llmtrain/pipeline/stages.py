"""Cutting a CausalLM into pipeline chunks: which layers go where, and the chunk modules themselves.

Stage ``s`` of ``pp * v`` holds a contiguous run of layers; the first also embeds, the last also applies
the final norm, the LM head and the loss. Rank ``r`` holds chunks ``c = 0..v-1`` = stages ``c * pp + r``,
or in a V (zb_v, dualpipe_v) stages ``r`` and ``2 pp - 1 - r`` (the layouts of ``schedules.py``); the V
puts the first and the last stage on rank 0, where a tied embedding stays one parameter. With tied
embeddings and the first and last stage on different ranks,
the last stage gets its own copy of the embedding matrix for its head: both copies start equal (broadcast
from the first stage) and their gradients are summed over the pair of ranks before the optimizer step.

Multi-token prediction (model.mtp_layers) runs on the last stage, which holds the modules and, as for a tied
head, its own copy of the embedding they embed the tokens ahead with (the head's copy when tied): kept equal
to the first stage's the same way, as Megatron-Core keeps its MTP embedding in sync.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.layout_rules import sequence_parallel_problem
from llmtrain.config.validate import raise_if_problem
from llmtrain.models import CausalLM
from llmtrain.models.layers import TransformerBlock
from llmtrain.models.moe import MoEMLP, Router, RouterStats
from llmtrain.models.mtp import shifted
from llmtrain.parallel import comm
from llmtrain.parallel.fsdp import local_tensor
from llmtrain.parallel.topology import Topology
from llmtrain.pipeline.partition import partition_layers
from llmtrain.pipeline.schedules import rank_of_stage, stage_of


class _ModelShell:
    """What chunks need of the whole model besides their layers (rotary tables, the loss), without
    keeping the other layers alive."""

    rope = CausalLM.rope
    _rope_from_positions = CausalLM._rope_from_positions

    def __init__(self, model: CausalLM) -> None:
        self.config = model.config
        self.spec = model.spec
        self.loss_tp_group = model.loss_tp_group
        self.context = model.context  # context parallelism's split (None without it)
        self._rope_cache: dict = {}
        # The cross-entropy alone: the router terms span stages (llmtrain.pipeline.router_stats).
        self.loss = types.MethodType(CausalLM.token_loss, self)


class StageModule(nn.Module):
    """One pipeline chunk: [embedding] + layers [first..last] + [final norm, head]; parameter names are
    those of the single-process model (``layers.<global index>...``)."""

    def __init__(
        self,
        model: CausalLM,
        shell: _ModelShell,
        stage: int,
        num_stages: int,
        layers: range,
        seq_shards: int,
    ) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.shell = shell
        self.seq_shards = seq_shards
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.embed_positions = model.embed_positions if self.is_first else None
        self.embed_dropout = model.embed_dropout if self.is_first else None
        # CausalLM.embed's switch: pipeline chunks gather their edges (llmtrain.config.vocab_sharding: pp=1).
        self.vocab_sharded = None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.mtp = model.mtp if self.is_last else None
        if self.mtp is not None and not self.is_first:  # the copy build_stages keeps equal to stage 0's
            self.embed_tokens, self.embed_dropout = model.embed_tokens, model.embed_dropout
        moe = [block for block in model.blocks() if isinstance(block.mlp, MoEMLP)]
        self.num_moe_layers = len(moe)
        mine = {id(block) for block in self.blocks()}
        self.router_rows = [row for row, block in enumerate(moe) if id(block) in mine]
        """This chunk's MoE blocks as rows of the model's (MoE blocks, experts) tables, in CausalLM.blocks
        order (the multi-token prediction blocks after the layers)."""

    def blocks(self) -> list[TransformerBlock]:
        """This chunk's transformer blocks: its layers, then (last stage) the multi-token prediction ones."""
        mtp = [m.block for m in self.mtp.layers] if self.mtp is not None else []
        return list(self.layers.values()) + mtp

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (b, s) on the first stage, hidden states otherwise -> hidden states; on the last stage
        the logits, or with `labels` (whole sequences') the loss (in training with the multi-token
        prediction term)."""
        context, positions = self.shell.context, None
        if self.is_first:
            if context is not None:  # whole sequences in, this CP rank's chunks on
                x, _, positions = context.split_inputs(x, None, None)
            seq = x.shape[1]
            x = CausalLM.embed(self, x, positions)  # type: ignore[arg-type]  # embed_tokens/positions/dropout
        else:
            seq = x.shape[1] * self.seq_shards  # sequence-parallel hidden states hold 1/tp of the sequence
            if context is not None:
                positions = context.positions(seq, x.device)
        rope = self.shell.rope(seq if positions is None else positions, x.device, x.dtype)
        for layer in self.layers.values():
            x = layer(x, rope)
        if not self.is_last:
            return x
        if labels is None:
            return self.lm_head(self.final_norm(x))
        loss = self.loss(self.lm_head(self.final_norm(x)), labels)
        if self.mtp is not None and self.training:
            # As CausalLM.forward: labels shifted on whole sequences, h^0 in the residual stream's layout.
            depths = [self._local(shifted(labels, k)) for k in range(len(self.mtp.layers) + 1)]
            embed = functools.partial(CausalLM.embed, self)
            loss = loss + self.mtp(self.final_norm.forward(x), depths, embed, self._head_loss, rope)
        return loss

    def _local(self, labels: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's part of whole sequences' `labels`."""
        return self.shell.context.local(labels) if self.shell.context is not None else labels

    def _head_loss(self, x: torch.Tensor, norm: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """The cross-entropy of this rank's `labels` through `norm` and the output layer."""
        return self.shell.loss(self.lm_head(norm(x)), labels)

    def _moe(self) -> list[MoEMLP]:
        return [layer.mlp for layer in self.blocks() if isinstance(layer.mlp, MoEMLP)]

    def routers(self) -> list[Router]:
        """This chunk's routers, in layer order (rows `router_rows`)."""
        return [mlp.router for mlp in self._moe()]

    def router_stats(self) -> list[RouterStats]:
        """The RouterStats of this chunk's MoE layers' last forward, in layer order."""
        return [mlp.stats for mlp in self._moe()]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's loss (mean fp32 cross-entropy over labels != -100, vocabulary-parallel under TP) of
        whole sequences' `labels`: under context parallelism the logits are this rank's chunks of them."""
        return self.shell.loss(logits, self._local(labels))


class PipelineStages(nn.Module):
    """This pipeline rank's chunks (``chunks[c]`` is stage ``c * pp + pp_rank``) and the tied-embedding
    bookkeeping. Hand it to build_optimizer like a model."""

    def __init__(self, chunks: list[StageModule], tied_group: Any, tied_param: nn.Parameter | None) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.tied_group = tied_group
        self.tied_param = tied_param

    def routers(self) -> list[Router]:
        """This rank's routers, chunk by chunk in layer order (rows `router_rows()`)."""
        return [router for chunk in self.chunks for router in chunk.routers()]

    def router_rows(self) -> list[int]:
        """This rank's MoE layers as rows of the model's (MoE layers, experts) tables."""
        return [row for chunk in self.chunks for row in chunk.router_rows]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the single-process names (detached clones)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            for name, p in chunk.named_parameters(remove_duplicate=False):
                out[name] = p.detach().clone()
        return out

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the two copies of a tied embedding (first and last stage)."""
        if self.tied_param is None:
            return
        buffers = getattr(self, "grad_buffers", None)
        if buffers is not None:
            buffers.finish()  # the data-parallel mean must be complete before summing the pair
            grad = self.tied_param.main_grad
        else:
            grad = self.tied_param.grad
            if grad is None:
                grad = self.tied_param.grad = torch.zeros_like(self.tied_param)
            # Under FSDP the two copies are sharded alike over the same DP coordinates: sum the shards.
            grad = local_tensor(grad)
        comm.all_reduce(grad, group=self.tied_group, detail="tied embedding gradients")


def _tied_pair_group(topo: Topology) -> Any:
    """The group {first stage, last stage} of this rank's (tp, cp, dp) coordinate; every rank joins the
    calls."""
    mine = None
    for tp_rank in range(topo.tp):
        for cp_rank in range(topo.cp):
            for dp_rank in range(topo.dp):
                at = dict(tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank)
                pair = [topo.rank_of(**at, pp_rank=p) for p in (0, topo.pp - 1)]
                group = dist.new_group(pair)
                if topo.rank in pair:
                    mine = group
    return mine


def build_stages(
    model: CausalLM,
    topo: Topology,
    virtual_stages: int = 1,
    layer_costs: Sequence[float] | None = None,
    embed_cost: float = 0.0,
    head_cost: float = 0.0,
    sequence_parallel: bool = False,
    stage_layers: Sequence[int] = (),
    v_shape: bool = False,
) -> PipelineStages:
    """This pipeline rank's chunks of ``model`` (already tensor-parallel if tp > 1). Every rank must have
    built the same model, or a meta one; the layers of other ranks are dropped with ``model``.
    ``stage_layers`` (parallel.stage_layers), when given, fixes the layers per chunk; ``v_shape`` places
    the chunks in a V (the zb_v and dualpipe_v schedules)."""
    pp, v = topo.pp, virtual_stages
    num_stages = pp * v
    ranges = partition_layers(len(model.layers), num_stages, layer_costs, embed_cost, head_cost, stage_layers)
    shell = _ModelShell(model)
    seq_shards = topo.tp if sequence_parallel else 1
    tied = model.config.tied_embeddings and model.lm_head.weight is model.embed_tokens.weight
    last_rank = rank_of_stage(v_shape, pp, num_stages - 1)[0]
    tied_param = None
    tied_group = None
    # The last stage uses the embedding matrix too: as its head when tied, to embed multi-token prediction's
    # tokens ahead with model.mtp_layers (then the head's copy serves both).
    if (tied or model.mtp is not None) and last_rank != 0:
        tied_group = _tied_pair_group(topo)
        if topo.pp_rank == last_rank:
            # The last stage's own copy: same values (broadcast below), marked so the global gradient norm
            # counts the pair once.
            copy = nn.Parameter(model.embed_tokens.weight.detach().clone())
            for attr in ("tp_layout", "duplicate", "sequence_parallel"):
                if hasattr(model.embed_tokens.weight, attr):
                    setattr(copy, attr, getattr(model.embed_tokens.weight, attr))
            copy.duplicate = True
            if tied:
                model.lm_head.weight = copy
            if model.mtp is not None:
                model.embed_tokens.weight = copy
            tied_param = copy
        elif topo.pp_rank == 0:
            tied_param = model.embed_tokens.weight
        # A meta model's copies are filled later from the same initial-value function (materialize).
        if tied_param is not None and not tied_param.is_meta:
            first = topo.rank_of(pp_rank=0)
            with torch.no_grad():
                comm.broadcast(tied_param.data, src=first, group=tied_group, detail="tied embedding")
    mine = [stage_of(v_shape, pp, topo.pp_rank, c) for c in range(v)]
    chunks = [StageModule(model, shell, s, num_stages, ranges[s], seq_shards) for s in mine]
    return PipelineStages(chunks, tied_group, tied_param)


def activation_shape(
    micro_batch_size: int,
    seq_length: int,
    hidden_size: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
) -> tuple[int, int, int]:
    """Shape of the hidden states passed between stages: (b, s / cp, h), divided by tp again with sequence
    parallelism."""
    seq = seq_length // cp
    if sequence_parallel:
        raise_if_problem(sequence_parallel_problem(seq, tp))
    return (micro_batch_size, seq // tp if sequence_parallel else seq, hidden_size)
