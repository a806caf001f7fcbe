"""FSDP2's all-gather and reduce-scatter as point-to-point shard exchange on gloo (parallel.fsdp_comm)
against what we did not write: gloo's own all_gather_into_tensor, and the sum of every rank's input
computed on one rank from the gathered inputs. Three ranks, so a shard has two peers and the summation
order matters: fp32 addition in group order gives the brute-force sum bit for bit.

ZeRO-2 launches every unit's gather after the optimizer step (llmtrain.parallel.fsdp.gather_after_step):
once waited for, each unsharded parameter must equal the updated sharded one gathered by DTensor's own
full_tensor (a gather launched before the update would hold the old weights and fail it). That ZeRO-2/3
still train like one process with the exchange is tests/parallel/test_fsdp.py's job (gloo, 4 ranks).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmtrain import models
from llmtrain.parallel import Topology, build_optimizer, parallelize
from llmtrain.parallel.fsdp import fsdp_modules, wait_gathers
from llmtrain.parallel.fsdp_comm import ExchangeAllGather, ExchangeReduceScatter
from tests.parallel._dist import batches, spawn, tiny_job

WORLD = 3
SHARD = 7


def _inputs(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    group = dist.group.WORLD
    shard = _inputs(rank, SHARD)
    want = torch.empty(SHARD * world)
    dist.all_gather_into_tensor(want, shard)
    gather = ExchangeAllGather(tag=10)
    got = torch.empty(SHARD * world)
    out["gather_sync"] = gather(got, shard, group) is None and torch.equal(got, want)
    got = torch.empty(SHARD * world)
    work = gather(got, shard, group, async_op=True)
    out["gather_async_is_work"] = isinstance(work, dist.Work)
    work.wait()
    out["gather_async"] = torch.equal(got, want)

    full = _inputs(rank, SHARD * world)
    everyone = torch.empty(world * SHARD * world)
    dist.all_gather_into_tensor(everyone, full)
    everyone = everyone.view(world, SHARD * world)
    mine = everyone[:, rank * SHARD : (rank + 1) * SHARD]
    brute = mine[0].clone()
    for row in mine[1:]:
        brute += row
    reduce = ExchangeReduceScatter(tag=11)
    for op, expected in ((dist.ReduceOp.SUM, brute), (dist.ReduceOp.AVG, brute / world)):
        got = torch.empty(SHARD)
        reduce(got, full, group, op)
        out[f"reduce_{op}"] = torch.equal(got, expected)
    try:
        reduce(torch.empty(SHARD), full, group, dist.ReduceOp.MAX)
        out["refuses_max"] = False
    except NotImplementedError:
        out["refuses_max"] = True

    job = tiny_job("gpt", zero_stage=2, dp=world)
    topo = Topology(job.parallel, world, rank)
    torch.manual_seed(job.train.seed)
    model = parallelize(models.build(job.model), topo, job)
    out["exchanges"] = all(
        isinstance(g._all_gather_comm, ExchangeAllGather)
        and isinstance(g._reduce_scatter_comm, ExchangeReduceScatter)
        for m in fsdp_modules(model)
        for g in m._get_fsdp_state()._fsdp_param_groups
    )
    opt = build_optimizer(model, topo, job)
    batch = batches(job, 1)[0].chunk(world)[rank]
    opt.zero_grad()
    opt.backward(model(batch[:, :-1], batch[:, 1:]))
    opt.step(1e-2)
    out["in_flight"] = len(model.fsdp_gathers_in_flight) == len(fsdp_modules(model))
    # DTensor's own gather of the updated shards, while the exchanges are still in flight.
    updated = {name: p.full_tensor() for name, p in model.named_parameters()}
    wait_gathers(model)
    whole = dict(model.named_parameters())
    out["gathered_updated"] = all(
        not isinstance(whole[name], DTensor) and torch.equal(whole[name], value)
        for name, value in updated.items()
    )
    return out


@functools.cache
def _results() -> list[dict]:
    return spawn(WORLD, _worker)


@pytest.mark.slow
@pytest.mark.parametrize(
    "check",
    [
        "gather_sync",
        "gather_async_is_work",
        "gather_async",
        f"reduce_{dist.ReduceOp.SUM}",
        f"reduce_{dist.ReduceOp.AVG}",
        "refuses_max",
        "exchanges",
        "in_flight",
        "gathered_updated",
    ],
)
def test_shard_exchange(check: str) -> None:
    for rank, out in enumerate(_results()):
        assert out[check] is True, f"rank {rank}: {check} = {out[check]}"
