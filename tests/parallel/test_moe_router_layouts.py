"""A mixture of experts with its router losses on (load-balancing and z-loss) under pipeline parallelism
(also on ZeRO-2/3 sharded stages) and context parallelism trains like one process: the pooled
load-balancing loss spans the pipeline stages (llmtrain.pipeline.router_stats) and the CP ranks' router
statistics are summed (llmtrain.parallel.context_parallel). The reference runs each micro-batch as training
accumulates them, since the load-balancing loss of a micro-batch is no mean over its tokens."""

from __future__ import annotations

import pytest

from llmtrain.parallel import Topology
from tests.parallel._dist import batches, parallel_run, sgd, spawn, tiny_job
from tests.parallel._reference import torch_reference

STEPS = 3
LR, SGD_LR = 1e-3, 1.0
ROUTER_LOSSES = dict(router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
INTERLEAVED = dict(schedule="interleaved_1f1b", virtual_stages=2, num_layers=4)
LAYOUTS = {
    2: [
        (dict(pp=2), "adamw"),
        (dict(pp=2), "sgd"),
        (dict(pp=2, **INTERLEAVED), "sgd"),
        (dict(pp=2, schedule="zb_h1"), "sgd"),
        (dict(pp=2, schedule="gpipe"), "adamw"),
        (dict(cp=2), "sgd"),
        (dict(cp=2, cp_comm="all_to_all"), "adamw"),
    ],
    4: [
        (dict(pp=2, ep=2), "sgd"),
        (dict(pp=2, ep=2, **INTERLEAVED), "adamw"),
        (dict(pp=2, cp=2), "sgd"),
        (dict(tp=2, cp=2, sequence_parallel=True), "sgd"),
        # FSDP2 (ZeRO-3 and ZeRO-2) on pipeline stages: the router losses' gradients through sharded routers.
        (dict(pp=2, zero_stage=3), "adamw"),
        (dict(pp=2, ep=2, zero_stage=2), "sgd"),
    ],
}


def _train_layouts(rank: int, world: int) -> list[str]:
    failures = []
    references = {}
    for settings, optimizer in LAYOUTS[world]:
        job = tiny_job("mixtral", **ROUTER_LOSSES, **settings)
        lr = SGD_LR if optimizer == "sgd" else LR
        if optimizer == "sgd":
            job.train.grad_clip = job.train.weight_decay = 0.0
        data = batches(job, STEPS)
        make = sgd(lr) if optimizer == "sgd" else None
        run = parallel_run(job, Topology(job.parallel, world, rank), data, lr, make)
        if rank != 0:
            continue
        key = (repr(job.model), optimizer)
        if key not in references:
            references[key] = torch_reference(
                job, data, lr, sgd=optimizer == "sgd", micro_batch_size=job.train.micro_batch_size
            )
        ref = references[key]
        name = f"mixtral {optimizer} world={world} {' '.join(f'{k}={v}' for k, v in settings.items())}"
        failures += ref.check(name, run["losses"], run["grad_norms"], run["state"])
        failures += ref.check_gap(name, run["losses"], run["grad_norms"])
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_router_losses_train_like_one_process(world: int) -> None:
    failures = [f for r in spawn(world, _train_layouts) for f in r]
    assert not failures, "\n".join(failures)
