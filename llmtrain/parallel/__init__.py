"""Tensor, sequence and data parallelism, the distributed optimizer and activation recomputation."""

from __future__ import annotations

from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.parallel.data_parallel import GradBuffers, apply_data_parallel, apply_dp, grad_sync
from llmtrain.parallel.launch import init_distributed
from llmtrain.parallel.optimizer import LossScaledOptimizer, ModelOptimizer, StepStats, build_optimizer
from llmtrain.parallel.random import RNGTracker
from llmtrain.parallel.recompute import apply_recompute, saved_activation_bytes
from llmtrain.parallel.tensor_parallel import apply_tp, gather_full_state_dict
from llmtrain.parallel.topology import Topology


def parallelize(model: nn.Module, topo: Topology, job: JobConfig) -> nn.Module:
    """apply_tp -> apply_recompute -> apply_data_parallel (flat buffers for zero_stage 0/1, FSDP2 for 2/3),
    in place. With pp > 1 the pipeline splits stages first and the data-parallel layout is applied to the
    stages (build_optimizer installs it on the module it is given)."""
    apply_tp(model, topo, job.parallel.sequence_parallel, job.train.seed)
    apply_recompute(model, job.model.recompute)
    if topo.pp == 1:
        apply_data_parallel(model, topo, job)
    return model


__all__ = [
    "GradBuffers",
    "LossScaledOptimizer",
    "ModelOptimizer",
    "RNGTracker",
    "StepStats",
    "Topology",
    "apply_data_parallel",
    "apply_dp",
    "apply_recompute",
    "apply_tp",
    "build_optimizer",
    "gather_full_state_dict",
    "grad_sync",
    "init_distributed",
    "parallelize",
    "saved_activation_bytes",
]
