"""Checkpoint round trips between layouts inside one gloo process group: a job built as training builds it,
trained on global batches, saved by one layout and resumed by another (run these in spawn()ed workers)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from llmtrain import models
from llmtrain.checkpoint import Checkpointer
from llmtrain.checkpoint.convert import read_full
from llmtrain.config import JobConfig
from llmtrain.parallel import Topology, build_optimizer, grad_sync, parallelize
from llmtrain.parallel.optimizer import LossScaledOptimizer
from tests.parallel._reference import ISSUE_GAP, worst_gap


class Trainee(NamedTuple):
    """One layout's job as training builds it: on meta, materialised per rank, with its optimizer and
    checkpointer (writing under job.output_dir)."""

    job: JobConfig
    topo: Topology
    model: torch.nn.Module
    opt: LossScaledOptimizer
    checkpointer: Checkpointer


def build_as_training(job: JobConfig, rank: int, world: int) -> Trainee:
    topo = Topology(job.parallel, world, rank)
    model = parallelize(models.empty_model(job.model, device="meta"), topo, job)
    return Trainee(job, topo, model, build_optimizer(model, topo, job), Checkpointer(job, topo))


def train_steps(t: Trainee, data: list[torch.Tensor], lr: float) -> list[float]:
    """Global-batch mean losses of one step per batch of `data` (the same on every rank)."""
    losses = []
    for batch in data:
        t.opt.zero_grad()
        micro = batch.chunk(t.topo.dp)[t.topo.dp_rank].split(t.job.train.micro_batch_size)
        loss = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(micro):
            with grad_sync(t.model, i == len(micro) - 1):
                part = t.model(mb[:, :-1], mb[:, 1:]) / len(micro)
                t.opt.backward(part)
            loss += part.detach() / t.topo.dp
        dist.all_reduce(loss, group=t.topo.dp_group)
        t.opt.step(lr)
        losses.append(loss.item())
    return losses


def save(t: Trainee, step: int) -> None:
    t.checkpointer.save(step, t.model, t.opt, {"step": step})


def resume_failures(
    what: str,
    saved: Path,
    loading: Trainee,
    step: int,
    data: list[torch.Tensor],
    expected: list[float],
    lr: float,
) -> list[str]:
    """Load the checkpoints under `saved` into `loading`, re-save them at `step` (the same state, written by
    this layout: compared bitwise with the loaded one as full tensors, model and optimizer), train on
    `data` and compare the losses with the uninterrupted run's `expected` (worst relative gap ISSUE_GAP)."""
    loading.checkpointer.load(saved, loading.model, loading.opt)
    save(loading, step)
    got = train_steps(loading, data, lr)
    failures = []
    gap = worst_gap(got, expected)
    if not gap <= ISSUE_GAP:
        failures.append(f"{what}: losses {got}, uninterrupted {expected}")
    dist.barrier()
    if loading.topo.rank == 0:
        before = read_full(saved)
        again = read_full(Path(loading.job.output_dir) / "checkpoints")
        if before.keys() != again.keys():
            failures.append(f"{what}: keys {sorted(before.keys() ^ again.keys())}")
        failures += [
            f"{what}: {key} differs once re-saved"
            for key in before.keys() & again.keys()
            if not torch.equal(before[key], again[key])
        ]
    return failures
