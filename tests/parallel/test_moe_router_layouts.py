"""A mixture of experts with its router losses on (load-balancing and z-loss) under pipeline parallelism
(also on ZeRO-2/3 sharded stages) and context parallelism trains like one process: the pooled
load-balancing loss spans the pipeline stages (llmtrain.pipeline.router_stats) and the CP ranks' router
statistics are summed (llmtrain.parallel.context_parallel). The reference runs each micro-batch as training
accumulates them, since the load-balancing loss of a micro-batch is no mean over its tokens."""

from __future__ import annotations

import pytest

from tests.parallel._dist import spawn
from tests.parallel._reference import train_layouts

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
        (dict(pp=2, ep=2, schedule="zb_v", virtual_stages=2, num_layers=4), "adamw"),  # the V, experts split
        (dict(pp=2, cp=2), "sgd"),
        (dict(tp=2, cp=2, sequence_parallel=True), "sgd"),
        # FSDP2 (ZeRO-3 and ZeRO-2) on pipeline stages: the router losses' gradients through sharded routers.
        (dict(pp=2, zero_stage=3), "adamw"),
        (dict(pp=2, ep=2, zero_stage=2), "sgd"),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_router_losses_train_like_one_process(world: int) -> None:
    layouts = [
        ("mixtral", {**ROUTER_LOSSES, **settings}, optimizer) for settings, optimizer in LAYOUTS[world]
    ]
    failures = [f for r in spawn(world, train_layouts, layouts) for f in r]
    assert not failures, "\n".join(failures)
