"""Single-process launch and the checks that need no process group (reference: the contract's rules)."""

from __future__ import annotations

import pytest

from llmtrain.config import ConfigError, JobConfig, ParallelConfig
from llmtrain.parallel import Topology, init_distributed
from llmtrain.parallel.launch import resolve_backend


def test_single_process_needs_no_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    topo = init_distributed(JobConfig())
    assert (topo.world_size, topo.rank, topo.tp, topo.pp, topo.dp) == (1, 0, 1, 1, 1)
    assert topo.tp_group is None and topo.dp_group is None and topo.pp_group is None
    assert topo.is_first_stage and topo.is_last_stage and topo.next_pp_rank == 0
    assert Topology.single().rank_of(tp_rank=0, dp_rank=0, pp_rank=0) == 0


def test_degrees_must_multiply_to_the_world_size() -> None:
    with pytest.raises(ConfigError, match="world size"):
        Topology(ParallelConfig(tp=2, pp=1, dp=2), world_size=3, rank=0)
    with pytest.raises(ConfigError, match="not divisible"):
        Topology(ParallelConfig(tp=2, pp=2), world_size=6, rank=0)
    with pytest.raises(ConfigError, match="parallel.order"):
        Topology(ParallelConfig(order="tp-dp"), world_size=1, rank=0)


def test_launch_without_rendezvous_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    job = JobConfig()
    job.train.global_batch_size, job.train.micro_batch_size = 8, 2
    with pytest.raises(RuntimeError, match="torchrun"):
        init_distributed(job)


def test_backend_auto_is_gloo_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        assert resolve_backend("auto") == "nccl"
    else:
        assert resolve_backend("auto") == "gloo"
        with pytest.raises(ConfigError, match="nccl"):
            resolve_backend("nccl")
