"""One training job from a config: the flow sketched in DESIGN.md, wired in one place."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from llmtrain.config import JobConfig, dump, with_overrides
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.watchdog import install_excepthook
from llmtrain.training.trainer import LocalStepRunner, Trainer, TrainResult


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initialisation before sharding, identical data order."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_trainer(job: JobConfig, topo: Topology) -> Trainer:
    """Data, model, parallel layout, optimizer, metrics and checkpointer for `job`, assembled."""
    from llmtrain.checkpoint import Checkpointer
    from llmtrain.data import build_data
    from llmtrain.models import build
    from llmtrain.parallel import build_optimizer, grad_sync, parallelize
    from llmtrain.pipeline.executor import PipelineStepRunner, build_pipeline
    from llmtrain.planner.flops import head_cost_in_layers, model_flops_per_token
    from llmtrain.training.metrics import MetricsLogger

    seed_everything(job.train.seed)
    data = build_data(job, dp_rank=topo.dp_rank, dp_size=topo.dp)
    if topo.rank == 0:
        Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        dump(job, Path(job.output_dir) / "config.yaml")
    # Built in fp32: parallelize casts to bf16/fp16 through its buffers and keeps the exact fp32 master.
    with torch.device(topo.device):
        model = parallelize(build(job.model), topo, job)
    if topo.pp > 1:
        head_cost = head_cost_in_layers(job.model) if job.parallel.balance_stages else 0.0
        model, executor = build_pipeline(model, topo, job, head_cost)
        optimizer = build_optimizer(model, topo, job)
        runner = PipelineStepRunner(executor, optimizer, job.train.micro_batch_size)
    else:
        optimizer = build_optimizer(model, topo, job)
        runner = LocalStepRunner(model, optimizer, job.train.micro_batch_size, grad_sync, topo.device)
    metrics = MetricsLogger(
        job,
        is_main=topo.rank == 0,
        flops_per_token=model_flops_per_token(job.model, job.model.seq_length),
        world_size=topo.world_size,
    )
    return Trainer(
        job=job,
        topo=topo,
        runner=runner,
        optimizer=optimizer,
        data=data,
        metrics=metrics,
        checkpointer=Checkpointer(job, topo),
        model=model,
        tokens_per_sample=job.model.seq_length,
    )


def plan_layout(job: JobConfig, world_size: int) -> JobConfig:
    """With parallel.auto, the planner's best layout for this world size (re-planned on every launch,
    so an elastic restart on another number of workers gets a layout for that number)."""
    from llmtrain.planner import plan_for_world

    overrides, explanation = plan_for_world(job, world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"parallel.auto for {world_size} processes:\n{explanation}", flush=True)
    return with_overrides(job, overrides)


def run(job: JobConfig) -> TrainResult:
    """Train `job` on the processes torchrun (or a plain `python`) started."""
    from llmtrain.parallel import init_distributed

    if job.train.num_threads:
        torch.set_num_threads(job.train.num_threads)
    if job.parallel.auto:
        job = plan_layout(job, int(os.environ.get("WORLD_SIZE", "1")))
    topo = init_distributed(job)
    install_excepthook(topo.rank)
    topo.watchdog.start()
    trainer = build_trainer(job, topo)
    try:
        return trainer.fit()
    finally:
        topo.watchdog.stop()
        trainer.metrics.close()
        trainer.checkpointer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
