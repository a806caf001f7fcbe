"""Joining the job's processes: torchrun's environment in, a Topology out."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig
from llmtrain.config.validate import validate_world
from llmtrain.parallel.topology import Topology


def resolve_backend(backend: str) -> str:
    """'auto' -> nccl when CUDA is usable, gloo otherwise; explicit choices are checked."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"parallel.backend must be auto, gloo or nccl; got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo or auto on CPU"
        )
    return backend


def init_distributed(job: JobConfig) -> Topology:
    """Initialise torch.distributed from torchrun's env vars (RANK, WORLD_SIZE, ...); build the Topology."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    validate_world(job, world_size)
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return Topology(job.parallel, 1, 0)
    if "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with torchrun "
            "(e.g. torchrun --nproc_per_node 4 tools/pretrain.py ...)"
        )
    backend = resolve_backend(job.parallel.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            # Later than the watchdog (parallel.timeout_s), so each rank reports where it waits first.
            timeout=datetime.timedelta(seconds=job.parallel.timeout_s * 1.5 + 30),
        )
    return Topology(job.parallel, dist.get_world_size(), dist.get_rank())
