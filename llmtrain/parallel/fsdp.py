"""ZeRO-2 and ZeRO-3 (and hybrid sharding) through PyTorch FSDP2.

``apply_fsdp`` calls ``fully_shard`` on every transformer block, on the input embedding and the output
layer (unless tied), and then on each root (the model, or each pipeline chunk) over a DeviceMesh of the
ranks holding this rank's parameters, its cp x dp ranks: 1-D ``(shard,)`` built on ``topo.dp_cp_group``
itself, or 2-D ``(replicate, shard)`` for hybrid sharding (HSDP: ``parallel.dp_shard`` DP ranks and all
their CP ranks share the shards of one replica, gradients are all-reduced across the dp / dp_shard
replicas; torchtitan's dp_shard x cp). The parameters FSDP shards are the fp32
model parameters, so they are the optimizer's master weights; bf16/fp16 compute comes from
``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``, which casts each gathered block.

zero_stage 2 keeps a block's gathered parameters from its forward to its backward
(``reshard_after_forward=False``): gradients (and optimizer state) sharded, parameters whole during the
step. zero_stage 3 frees them after the forward and gathers them again for the backward.

Gradient accumulation (``parallel.grad_reduce``): by default every micro-batch's backward reduce-scatters its
gradients, which FSDP2 sums into the fp32 shards, so no rank ever holds a whole gradient; with ``step`` the
trainer turns gradient sync off for all but the last micro-batch and FSDP2 accumulates unsharded fp32
gradients (4 bytes a parameter of the rank's model) for one reduction per step.

TP layers stay plain local tensors: FSDP shards each rank's TP slice over the DP mesh, which is why the
attributes tensor_parallel.py puts on parameters (``duplicate``, ``sequence_parallel``, ``kv_replicas``,
``tp_layout``) and expert_parallel.py's ``expert_slice`` are copied onto the sharded parameters here.

Under expert parallelism each MoE layer's experts are a unit of their own, sharded over the expert-DP mesh
(the ranks holding the same experts, tp x cp x dp / ep of them). An EP rank's expert gradient already sums
the tokens of its whole EP group, so the reduction over that mesh sums and divides by dp, not by the mesh's
size (llmtrain.parallel.expert_parallel).

Context parallelism: each CP rank's gradient is that of its part of the sequences' loss (the loss is
weighted by labelled tokens over the CP group, llmtrain.parallel.context_parallel), so the reduction sums
over cp and averages over dp, as GradBuffers does at zero 0/1: the divide factor is dp, not the mesh's
dp x cp.

Both are a plain sum then a division of the shard by dp (``set_gradient_divide_factor`` with
``set_force_sum_reduction_for_comms``): gloo has no PREMUL_SUM, and the division touches 1/shards of the
gradient. An expert-DP mesh of one rank (ep = tp x cp x dp) reduces nothing: its gradient is only divided.

Under train.fp8_all_gather (llmtrain.config.engine_rules.float8_all_gather) the float8 linears' weights are
torchao's float8-all-gather parameters before fully_shard, so ZeRO-3 gathers them as float8 bytes, and
FSDPOptimizer sets their scales after each step (llmtrain.parallel.float8_gather).

Where llmtrain.config.vocab_sharding allows it, the embedding and the output layer are never gathered in
training: each rank works on its vocabulary rows for the whole shard group's tokens
(llmtrain.parallel.vocab_sharded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from llmtrain.config.engine_rules import float8_all_gather
from llmtrain.config.schema import JobConfig
from llmtrain.config.vocab_sharding import vocab_sharded_edges
from llmtrain.parallel.dtensor_shards import local_tensor
from llmtrain.parallel.float8_gather import precompute_weight_scales, wrap_float8_weights
from llmtrain.parallel.fsdp_comm import use_shard_exchange
from llmtrain.parallel.muon import MuonAdamW, fsdp_matrices, stage_group
from llmtrain.parallel.optimizer import LossScaledOptimizer, MakeOptimizer, make_param_groups
from llmtrain.parallel.param_layout import named_parameters_once
from llmtrain.parallel.tensor_parallel import reduce_tp_grads
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.vocab_sharded import VocabShardedEdges
from llmtrain.precision import torch_dtype

PARAM_ATTRIBUTES = ("tp_layout", "duplicate", "sequence_parallel", "kv_replicas", "expert_slice")


def dp_shard_size(job: JobConfig, dp: int) -> int:
    """The number of DP ranks that share one copy of the sharded state (parallel.dp_shard, null = dp)."""
    return job.parallel.dp_shard or dp


def dp_mesh(topo: Topology, dp_shard: int) -> DeviceMesh:
    """This rank's cp x dp ranks as a DeviceMesh: (shard,) on topo.dp_cp_group, or (replicate, shard) with
    ``dp_shard`` < dp, a replica being DP ranks replica * dp_shard .. + dp_shard - 1 with all their CP ranks.
    Every rank must call it (new groups)."""
    device_type = topo.device.type
    if dp_shard == topo.dp:
        ranks = topo.dp_cp_ranks()
        return DeviceMesh.from_group(topo.dp_cp_group, device_type, mesh=ranks, mesh_dim_names=("shard",))
    replicas = topo.dp // dp_shard
    shard_group = replicate_group = mine = None
    # Every rank joins every new_group call, in the same order: all (tp, pp) coordinates, shards first.
    for tp_rank in range(topo.tp):
        for pp_rank in range(topo.pp):
            at = {"tp_rank": tp_rank, "pp_rank": pp_rank}
            # Sorted as new_group orders a group's ranks, so a rank's mesh coordinate is its group rank. The
            # rows are translates of one another (dp_shard DP ranks apart), so each column is sorted too.
            grid = [
                sorted(
                    topo.rank_of(**at, cp_rank=c, dp_rank=r * dp_shard + s)
                    for s in range(dp_shard)
                    for c in range(topo.cp)
                )
                for r in range(replicas)
            ]
            for ranks in grid:
                group = dist.new_group(ranks)
                if topo.rank in ranks:
                    shard_group, mine = group, grid
            for s in range(dp_shard * topo.cp):
                ranks = [row[s] for row in grid]
                group = dist.new_group(ranks)
                if topo.rank in ranks:
                    replicate_group = group
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=torch.tensor(mine),
        mesh_dim_names=("replicate", "shard"),
    )


def _roots(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP treats as roots: each pipeline chunk, or the whole model."""
    chunks = getattr(model, "chunks", None)
    return list(chunks) if chunks is not None else [model]


def _blocks(root: nn.Module) -> list[nn.Module]:
    """The root's transformer blocks (a CausalLM or a pipeline chunk): its layers, then its multi-token
    prediction modules' blocks."""
    return root.blocks()


def _edges(root: nn.Module) -> list[nn.Module]:
    """The root's input embedding and output layer (those it has)."""
    return [m for m in (getattr(root, "embed_tokens", None), getattr(root, "lm_head", None)) if m is not None]


def _edge_units(
    root: nn.Module, zero_stage: int, vocab_sharded: bool
) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """The input embedding and the output layer (final norm + head) as FSDP units of their own, each with
    its reshard_after_forward, as torchtitan wraps them: in the root they would stay gathered from the
    forward's first layer to the backward's last, beside every block; a vocabulary-sized matrix each.
    The embedding reshards after the forward at zero 3; the output layer does not, since the backward
    starts with it. A tied embedding and head share one weight, hence one unit: the root.

    ``vocab_sharded`` (llmtrain.parallel.vocab_sharded): training never calls either module, it reads their
    shards; only a forward for logits gathers the head, which then reshards at once. The final norm stays
    in the root, as calling it must not gather the head.

    With multi-token prediction (model.mtp_layers) each forward calls the embedding and the output layer
    once per depth more, which an FSDP unit of its own does not allow (one forward and one backward per
    unit and step): they stay in the root, gathered from the forward's start to the backward's end."""
    embed, head = getattr(root, "embed_tokens", None), getattr(root, "lm_head", None)
    if embed is not None and head is not None and head.weight is embed.weight:
        return []
    if getattr(root, "mtp", None) is not None and not vocab_sharded:
        return []
    if vocab_sharded:
        return [(embed, True), (head, True)]
    units: list[tuple[nn.Module | list[nn.Module], bool]] = []
    if embed is not None:
        units.append((embed, zero_stage == 3))
    if head is not None:
        units.append(([root.final_norm, head], False))
    return units


def apply_fsdp(model: nn.Module, topo: Topology, job: JobConfig) -> nn.Module:
    """Shard ``model`` (a CausalLM or PipelineStages, fp32, TP applied) with FSDP2 in place: each block,
    then each root; see the module docstring. On a meta model the shards stay meta until
    llmtrain.parallel.materialize allocates and fills only this rank's."""
    zero_stage = job.parallel.zero_stage
    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp serves zero_stage 2 and 3; got {zero_stage}")
    if is_fsdp(model):
        raise RuntimeError("apply_fsdp was already applied to this model")
    dtype = torch_dtype(job.train.precision)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
    )
    mesh = dp_mesh(topo, dp_shard_size(job, topo.dp))
    if float8_all_gather(job):  # train.fp8_all_gather: the float8 linears' weights gathered in float8
        wrap_float8_weights(model)
    named = list(model.named_parameters(remove_duplicate=False))
    attributes = {name: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)} for name, p in named}
    tied_name = None
    tied = getattr(model, "tied_param", None)
    if tied is not None:
        # PipelineStages registers its tied embedding under its own name too; the chunk's name survives.
        tied_name = next(n for n, p in named if p is tied and n != "tied_param")
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy}
    expert_mesh = None
    if topo.ep > 1:
        expert_mesh = DeviceMesh.from_group(
            topo.expert_dp_group, topo.device.type, mesh=topo.expert_dp_ranks(), mesh_dim_names=("shard",)
        )
    expert_units: list[nn.Module] = []
    vocab_sharded = vocab_sharded_edges(
        zero_stage,
        topo.tp,
        topo.pp,
        topo.cp,
        topo.dp,
        job.parallel.dp_shard,
        job.model.vocab_size,
        job.model.tied_embeddings,
    )
    for root in _roots(model):
        for block in _blocks(root):
            experts = getattr(block.mlp, "experts", None)
            if expert_mesh is not None and experts is not None:
                fully_shard(
                    experts, mesh=expert_mesh, mp_policy=mp_policy, reshard_after_forward=zero_stage == 3
                )
                expert_units.append(experts)
            fully_shard(block, reshard_after_forward=zero_stage == 3, **options)
        for unit, reshard in _edge_units(root, zero_stage, vocab_sharded):
            fully_shard(unit, reshard_after_forward=reshard, **options)
        if vocab_sharded:
            root.vocab_sharded = VocabShardedEdges(topo.dp_cp_group, mp_policy.param_dtype, job.model.kernels)
        # What is left on the root (a tied embedding and head, position embeddings) is needed first and last.
        fully_shard(root, reshard_after_forward=False, **options)
    expert_ids = {id(unit) for unit in expert_units}
    # The vocabulary-sharded edges are never gathered in training (their shards are read directly).
    never_gathered = {id(m) for root in _roots(model) if vocab_sharded for m in _edges(root)}
    gathered_after_step: list[FSDPModule] = []
    for unit, module in enumerate(fsdp_modules(model)):
        expert = id(module) in expert_ids
        exchanged = use_shard_exchange(module, expert_mesh if expert else mesh, unit)
        if exchanged and zero_stage == 2 and id(module) not in never_gathered:
            gathered_after_step.append(module)
        # Sum over the mesh, divide by dp (module docstring): every unit under CP, the experts under EP.
        # Without either, FSDP's mean over the dp mesh is already that.
        if topo.cp > 1 or expert:
            module.set_gradient_divide_factor(float(topo.dp))
            # On a one-rank mesh (experts at expert_dp = 1) torch divides by the factor when it copies the
            # gradient in place of a reduce-scatter, and again after a forced sum: force the sum (gloo has
            # no PREMUL_SUM) only where ranks reduce.
            module.set_force_sum_reduction_for_comms((topo.expert_dp if expert else topo.dp_cp) > 1)
    if tied_name is not None:
        model.tied_param = model.get_parameter(tied_name)
    for name, p in model.named_parameters(remove_duplicate=False):
        for key, value in attributes.get(name, {}).items():
            setattr(p, key, value)
    model.fsdp_replica = mesh.get_local_rank("replicate") if mesh.ndim == 2 else 0
    # ZeRO-2 keeps the parameters whole through the step anyway, so gathering them right after the update
    # costs no memory and lets the transfers overlap the next forward (measured on gloo; NCCL's gathers
    # already overlap through FSDP2's prefetching on its own streams).
    model.fsdp_gather_after_step = gathered_after_step
    model.fsdp_gathers_in_flight = []
    model.fsdp_reduce_every_microbatch = job.parallel.grad_reduce == "microbatch"
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that fully_shard was applied to."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` (or a pipeline chunk of it) is sharded by apply_fsdp."""
    return bool(fsdp_modules(model))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce-scatter (and, with HSDP, all-reduce) gradients in this backward, or only accumulate them:
    only with parallel.grad_reduce=step, else every backward reduces (below)."""
    # parallel.grad_reduce=microbatch (the default, as DeepSpeed's ZeRO-2/3 and torchtitan do): every
    # micro-batch's gradients are reduce-scattered and summed into the fp32 shards, so accumulation holds
    # no unsharded fp32 gradient of the whole model (4 bytes a parameter, more than the shards of
    # everything else at scale); "step" trades that memory for one reduction per step.
    enabled = enabled or getattr(model, "fsdp_reduce_every_microbatch", False)
    # The vocabulary-sharded edges are never gathered, so they hold no unsharded gradient to keep back (their
    # gradients land on the shards directly); FSDP2's post-backward without sync would look for one.
    always = {id(m) for root in _roots(model) if getattr(root, "vocab_sharded", None) for m in _edges(root)}
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(enabled or id(module) in always, recurse=False)
    model.fsdp_sync_enabled = enabled


def finish_backward(root: nn.Module) -> None:
    """End a backward of ``root`` (a model or a pipeline chunk: the module fully_shard was last applied to)
    as FSDP2 does, for gradients accumulated outside the autograd backward of its units: every unit's
    post-backward folds the unsharded gradients into its reduce-dtype (fp32) accumulators or, inside
    ``grad_sync(model, True)``, reduce-scatters them (with HSDP also all-reduces) into the sharded
    ``.grad``; then the reductions are waited for. With gradient sync every DP rank must call it at the
    same point (collectives).

    The zero-bubble W actions (llmtrain.pipeline.executor) accumulate weight gradients, through autograd
    onto the leaves, into the unsharded parameters of units whose backward already ran (in I); no FSDP
    hook runs then. FSDP2 has no public "reduce now", and reduce-scattering them ourselves would
    duplicate its padding, divide factors, mixed-precision casts, HSDP all-reduce and accumulation into
    existing sharded gradients. Its end-of-backward callback is exactly this work: it runs the
    post-backward of every unit whose autograd backward did not (after I's backward, all of them:
    accumulate, reduce or not, reshard -- a no-op, I resharded them), then waits for the reductions and
    frees their buffers. So this calls that callback on the root's state (a private method of torch's
    FSDP2; tests/parallel/test_fsdp.py's zb_h1 cases pin its behaviour)."""
    if not isinstance(root, FSDPModule):
        raise TypeError(f"finish_backward needs an FSDP root module; got {type(root).__name__}")
    root._get_fsdp_state()._root_post_backward_final_callback()


def gather_after_step(model: nn.Module) -> None:
    """After the optimizer updated the shards (ZeRO-2 on gloo): launch every unit's parameter all-gather in
    forward order, without waiting. A unit's forward waits for its own (FSDP2's pre-forward finds the
    gather launched); ``wait_gathers`` waits for all."""
    model.fsdp_gathers_in_flight = [
        module.unshard(async_op=True) for module in getattr(model, "fsdp_gather_after_step", [])
    ]


def wait_gathers(model: nn.Module) -> None:
    """Wait for the all-gathers gather_after_step launched (no-op for those a forward already waited for)."""
    for handle in getattr(model, "fsdp_gathers_in_flight", []):
        if handle is not None:
            handle.wait()
    model.fsdp_gathers_in_flight = []


class FSDPOptimizer(LossScaledOptimizer):
    """AdamW (or ``make_optimizer``'s rule) over this rank's FSDP2 shards of the fp32 parameters, with the
    trainer's prepare/apply/skip protocol of LossScaledOptimizer. The gradients are DTensor shards that
    FSDP reduce-scattered (averaged over DP, summed over CP ranks) in the backward (parallel.grad_reduce)."""

    def __init__(
        self, model: nn.Module, topo: Topology, job: JobConfig, make_optimizer: MakeOptimizer | None = None
    ) -> None:
        super().__init__(topo, job)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # A replica (HSDP) holds the same shards as replica 0: only replica 0's count in the global norm.
        replica = getattr(model, "fsdp_replica", 0)
        self._counted_params = [p for p in self.params if not getattr(p, "duplicate", False) and replica == 0]
        self._tp_reduced = [
            p
            for p in self.params
            if getattr(p, "sequence_parallel", False) or getattr(p, "kv_replicas", 1) > 1
        ]
        # Each rank's shards are distinct across the DP mesh and TP/PP ranks hold different parameters.
        self._norm_group, self._norm_ranks = None, topo.world_size
        named = named_parameters_once(model)
        self._float8_gathered = float8_all_gather(job)  # apply_fsdp wrapped the float8 weights
        matrices = fsdp_matrices(named, topo) if job.train.optimizer == "muon" else []
        muon = {id(m.key) for m in matrices}
        groups = make_param_groups([(n, p) for n, p in named if id(p) not in muon], job.train.weight_decay)
        self.optimizer = self._build(groups, make_optimizer, topo.device) if groups else None
        if matrices:
            self.optimizer = MuonAdamW(self.optimizer, matrices, job, *stage_group(topo), topo.device)

    def zero_grad(self) -> None:
        """Drop the gradients (FSDP assigns fresh sharded ones at the next synchronised backward)."""
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self.params if p.grad is not None]

    def _counted_grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self._counted_params if p.grad is not None]

    def _finish_reduction(self) -> None:
        if not getattr(self.model, "fsdp_sync_enabled", True):
            raise RuntimeError(
                "the optimizer step came after a backward without gradient synchronisation: run the last "
                "micro-batch outside llmtrain.parallel.grad_sync(model, False)"
            )
        # FSDP's reduction finished with the backward; TP partial gradients are summed over their shards.
        with torch.no_grad():
            reduce_tp_grads(self._tp_reduced, self.topo, lambda p: local_tensor(p.grad))

    def _publish(self) -> None:
        if self._float8_gathered:  # train.fp8_all_gather: the wrapped weights' scales for the next gathers
            precompute_weight_scales(self.model)
        gather_after_step(self.model)
