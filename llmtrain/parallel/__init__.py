"""Tensor, sequence, context and data parallelism, the distributed optimizer and activation recomputation."""

from __future__ import annotations

from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.parallel.compile_blocks import apply_compile
from llmtrain.parallel.context_parallel import apply_cp
from llmtrain.parallel.data_parallel import GradBuffers, apply_dp
from llmtrain.parallel.expert_parallel import apply_ep
from llmtrain.parallel.float8 import apply_float8
from llmtrain.parallel.launch import init_distributed
from llmtrain.parallel.materialize import is_meta, materialize
from llmtrain.parallel.optimizer import LossScaledOptimizer, ModelOptimizer, StepStats
from llmtrain.parallel.random import RNGTracker
from llmtrain.parallel.recompute import apply_recompute, saved_activation_bytes
from llmtrain.parallel.tensor_parallel import apply_tp, gather_full_state_dict
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.zero import apply_data_parallel, build_optimizer, grad_sync


def parallelize(model: nn.Module, topo: Topology, job: JobConfig) -> nn.Module:
    """apply_tp -> apply_ep -> apply_cp -> apply_float8 -> apply_recompute -> apply_compile ->
    [materialize] -> apply_data_parallel (flat buffers for zero_stage 0/1), or -> apply_data_parallel ->
    [materialize] (FSDP2 for 2/3), in place. A meta model (built under torch.device("meta")) is sharded
    on meta, then this rank's slices (at zero_stage 2/3 its FSDP shards of them) are allocated on
    topo.device and initialised from train.seed. With pp > 1 the pipeline splits stages first, then does
    the same to them (llmtrain.pipeline.executor.build_pipeline; build_optimizer applies the zero_stage 0/1
    layout)."""
    apply_tp(model, topo, job.parallel.sequence_parallel, job.train.seed)
    apply_ep(model, topo)
    apply_cp(model, topo, job.parallel.cp_comm)
    apply_float8(model, topo, job.train)
    apply_recompute(model, job.model.recompute, job.model.recompute_layers)
    apply_compile(model, job.train.compile)
    if topo.pp == 1:
        # FSDP2 (zero_stage 2/3) shards meta parameters, so each rank then allocates only its shards;
        # GradBuffers (0/1) copy the parameters' values into their flat buffers, so they come after.
        shards_first = job.parallel.zero_stage >= 2
        if shards_first:
            apply_data_parallel(model, topo, job)
        if is_meta(model):
            materialize(model, topo, job.model, job.train.seed, topo.device)
        if not shards_first:
            apply_data_parallel(model, topo, job)
    return model


__all__ = [
    "apply_compile",
    "GradBuffers",
    "LossScaledOptimizer",
    "ModelOptimizer",
    "RNGTracker",
    "StepStats",
    "Topology",
    "apply_cp",
    "apply_data_parallel",
    "apply_dp",
    "apply_ep",
    "apply_float8",
    "apply_recompute",
    "apply_tp",
    "build_optimizer",
    "gather_full_state_dict",
    "grad_sync",
    "init_distributed",
    "is_meta",
    "materialize",
    "parallelize",
    "saved_activation_bytes",
]
