"""Joining the job's processes: torchrun's environment in, a Topology out."""

from __future__ import annotations

import datetime
import os
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig
from llmtrain.config.validate import validate_world
from llmtrain.launch_env import launch_attempt, launch_rank
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.watchdog import HANG_REPORTS, enable_flight_recorder, process_group_timeout


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


def restart_warnings(job: JobConfig) -> list[str]:
    """What to say at the first launch about failures that torchrun's restarts would not recover from."""
    warnings = []
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and not (job.checkpoint.interval or job.checkpoint.interval_minutes):
        warnings.append(
            f"note: torchrun restarts the workers after a failure (--max-restarts {restarts}), but "
            "checkpoint.interval=0 and checkpoint.interval_minutes=0 save no checkpoint before the end, so "
            "a restart trains again from where this launch starts; set checkpoint.interval to resume from "
            "the last checkpoint instead"
        )
    agents = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if agents > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch's dynamic rendezvous keeps each agent's store address from the round it first joined, so
        # when the agent hosting the store changes, agents hand their workers different stores.
        warnings.append(
            f"note: {agents} torchrun agents share one agent's store; if agents leave or join, the workers "
            "of different agents can be sent to different stores and wait for each other until timeout "
            "(torch's shared rendezvous store); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun "
            "on every node to survive changes of membership"
        )
    return warnings


def init_distributed(job: JobConfig) -> Topology:
    """Initialise torch.distributed from torchrun's env vars (RANK, WORLD_SIZE, ...); build the Topology."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = launch_rank()
    validate_world(job, world_size)
    if rank == 0 and launch_attempt() == 0:
        for warning in restart_warnings(job):
            print(warning, file=sys.stderr, flush=True)
    hang = {"hang_timeout_s": job.train.hang_timeout_s, "report_dir": Path(job.output_dir) / HANG_REPORTS}
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return Topology(job.parallel, 1, 0, **hang)
    if "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with torchrun "
            "(e.g. torchrun --nproc_per_node 4 tools/pretrain.py ...)"
        )
    backend = resolve_backend(job.parallel.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        # Later than the watchdog (train.hang_timeout_s), so each rank reports where it waits first.
        timeout = process_group_timeout(job.train.hang_timeout_s)
        enable_flight_recorder(backend, hang["report_dir"])
        dist.init_process_group(
            backend,
            store=launch_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    return Topology(job.parallel, dist.get_world_size(), dist.get_rank(), **hang)


def launch_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT (torchrun's, or rank 0's), under a prefix of this launch's own.

    torchrun's agent keeps one store for the whole job (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so
    after a restart or a membership change the keys that the previous workers wrote, their gloo addresses
    among them, are still there and the new workers would read them and connect to dead processes.
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    job_store = dist.PrefixStore(f"llmtrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/", store)
    return dist.PrefixStore(f"launch/{_launch_token(job_store, rank, world_size)}/", job_store)


def _launch_token(store: dist.Store, rank: int, world_size: int) -> str:
    """A token that no earlier launch on `store` used, the same on every rank of this launch.

    TORCHELASTIC_RESTART_COUNT cannot be it: each agent counts only its own workers' failures, not the
    membership changes that restart every agent's workers. So rank 0 makes a token and gives it to each
    rank in answer to a nonce that rank has just made; a nonce that dead workers left in the queue gets an
    answer nobody reads. The last rank to take the token enqueues its end, which no earlier launch can have
    written, and rank 0 stops there. Every wait is bounded by the store's timeout.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.queue_push("hello", nonce)
        token = store.get(f"reply/{nonce}").decode()
        if store.add(f"taken/{token}", 1) == world_size - 1:
            store.queue_push("hello", f"end/{token}")
        return token
    token = uuid.uuid4().hex
    if world_size == 1:
        return token
    while (request := store.queue_pop("hello").decode()) != f"end/{token}":
        if not request.startswith("end/"):
            store.set(f"reply/{request}", token)
    return token
