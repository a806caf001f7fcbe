"""TP / SP / PP / DP / ZeRO-1 layouts train like one process. The reference: plain torch in float64, with
the bounds an fp32 run must stay within (tests/parallel/_reference.py). Two optimizers: AdamW with clipping
(losses, gradient norms and weights), and plain SGD without clipping or weight decay, under which a
gradient scaled by the wrong degree (dp, tp, pp, micro-batches) shows in its parameter's update -- Adam
normalises such a factor away and clipping hides it in the norm."""

from __future__ import annotations

import functools

import pytest
import torch

from llmtrain.parallel import Topology
from tests.parallel._dist import batches, parallel_run, sgd, spawn, tiny_job
from tests.parallel._reference import stored_reference, torch_reference

# Three Adam steps, as test_fsdp.py: from the second on, the update mixes moments of several gradients, so
# a wrong shard of Adam's state, a stale bucket or a wrongly scaled gradient shows there (the first step's
# update is ~lr * sign(g) whatever the gradient's scale); later steps repeat the same code.
STEPS = 3
LR = 1e-3
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2)]}  # (tp, dp) with AdamW
SGD_STEPS = 3
# Large enough that an update is far above the rounding of the weight it moves (~1e-3 against 1e-9).
SGD_LR = 1.0
# (tp, pp, dp, zero_stage, sequence_parallel, schedule): every degree a gradient could wrongly be scaled by,
# with 2 or 4 micro-batches per step; zb_h1 defers the weight gradients of TP layers to W actions.
SGD_LAYOUTS = {
    2: [
        (2, 1, 1, 0, False, "1f1b"),
        (2, 1, 1, 0, True, "1f1b"),
        (1, 2, 1, 0, False, "1f1b"),
        (1, 1, 2, 0, False, "1f1b"),
        (1, 1, 2, 1, False, "1f1b"),
    ],
    4: [
        (4, 1, 1, 0, False, "1f1b"),
        (2, 2, 1, 0, True, "zb_h1"),
        (2, 1, 2, 1, True, "1f1b"),
        (1, 2, 2, 1, False, "1f1b"),
    ],
}


def _cases(world: int) -> list[tuple[str, int, int, bool, int]]:
    # ZeRO-1 only where there is more than one DP rank to shard over: at dp=1 its single shard is the whole
    # state and its reduce-scatter a copy; ZeRO-1 under TP is the tp=2 dp=2 case of world 4.
    return [
        (arch, tp, dp, sp, zero)
        for arch in ("gpt", "llama", "ernie")
        for tp, dp in LAYOUTS[world]
        for sp in ((False, True) if tp > 1 else (False,))
        for zero in ((0, 1) if dp > 1 else (0,))
    ]


def _topology_facts(rank: int, world: int) -> dict:
    """Group memberships for a few layouts and rank orders (world 4)."""
    from torch.distributed import get_process_group_ranks

    from llmtrain.config import ParallelConfig

    facts = {}
    for tp, pp, dp, order in ((2, 2, 1, "tp-dp-pp"), (2, 2, 1, "pp-dp-tp"), (2, 1, 2, "tp-dp-pp")):
        topo = Topology(ParallelConfig(tp=tp, pp=pp, dp=dp, order=order), world, rank)
        facts[(tp, pp, dp, order)] = {
            "tp": get_process_group_ranks(topo.tp_group),
            "pp": get_process_group_ranks(topo.pp_group),
            "dp": get_process_group_ranks(topo.dp_group),
            "coords": (topo.tp_rank, topo.pp_rank, topo.dp_rank),
            "next_prev": (topo.next_pp_rank, topo.prev_pp_rank),
            "first_last": (topo.is_first_stage, topo.is_last_stage),
        }
    return facts


def _adamw_layouts(rank: int, world: int) -> list[str]:
    failures = []
    for arch, tp, dp, sp, zero in _cases(world):
        job = tiny_job(arch, tp=tp, dp=dp, sequence_parallel=sp, zero_stage=zero)
        data = batches(job, STEPS)
        run = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
        if rank != 0:
            continue
        name = f"AdamW {arch} tp={tp} dp={dp} sp={sp} zero={zero}"
        # One float64 run per arch for the session: both world sizes and the one-process test share it.
        failures += stored_reference(job, data, LR).check(
            name, run["losses"], run["grad_norms"], run["state"]
        )
        if any(s.skipped for s in run["stats"]):
            failures.append(f"{name}: skipped steps")
    return failures


def _sgd_layouts(rank: int, world: int) -> list[str]:
    failures = []
    for arch in ("gpt", "llama"):
        for tp, pp, dp, zero, sp, schedule in SGD_LAYOUTS[world]:
            job = tiny_job(arch, tp=tp, pp=pp, dp=dp, zero_stage=zero, sequence_parallel=sp)
            job.parallel.schedule = schedule
            job.train.grad_clip = job.train.weight_decay = 0.0
            data = batches(job, SGD_STEPS)
            run = parallel_run(job, Topology(job.parallel, world, rank), data, SGD_LR, sgd(SGD_LR))
            if rank != 0:
                continue
            name = f"SGD {arch} tp={tp} pp={pp} dp={dp} zero={zero} sp={sp} {schedule}"
            failures += stored_reference(job, data, SGD_LR, sgd=True).check(
                name, run["losses"], run["grad_norms"], run["state"]
            )
    return failures


def _compare(rank: int, world: int) -> dict:
    return {
        "adamw": _adamw_layouts(rank, world),
        "sgd": _sgd_layouts(rank, world),
        "topology": _topology_facts(rank, world) if world == 4 else None,
    }


@functools.cache
def _results(world: int) -> list[dict]:
    return spawn(world, _compare)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world: int) -> None:
    results = _results(world)
    failures = results[0]["adamw"]
    assert not failures, "\n".join(failures)
    if world == 4:
        _check_topology([r["topology"] for r in results])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_gradient_has_the_single_process_scale(world: int) -> None:
    failures = _results(world)[0]["sgd"]
    assert not failures, "\n".join(failures)


def _check_topology(facts: list[dict]) -> None:
    # Megatron's default order, tp innermost: ranks 0,1 share a tensor group, pipelines run 0->2 and 1->3.
    default = [f[(2, 2, 1, "tp-dp-pp")] for f in facts]
    assert [f["tp"] for f in default] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [f["pp"] for f in default] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [f["coords"] for f in default] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [f["next_prev"] for f in default] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [f["first_last"] for f in default] == [(True, False)] * 2 + [(False, True)] * 2
    # pp innermost: neighbouring ranks are consecutive stages.
    swapped = [f[(2, 2, 1, "pp-dp-tp")] for f in facts]
    assert [f["pp"] for f in swapped] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [f["tp"] for f in swapped] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    data = [f[(2, 1, 2, "tp-dp-pp")] for f in facts]
    assert [f["dp"] for f in data] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("arch", "layers"),
    # 8 layers take about 9 s on 2 cores: with the multi-second tests.
    [("gpt", 2), ("llama", 2), ("ernie", 2), pytest.param("llama", 8, marks=pytest.mark.slow)],
)
def test_single_process_stack_matches_torch(arch: str, layers: int) -> None:
    """Our stack (flat buffers, accumulation over micro-batches, ModelOptimizer) within the fp32 bounds of
    the float64 run, and torch's own fp32 run too: the bounds are not below fp32 noise."""
    job = tiny_job(arch, num_layers=layers)
    data = batches(job, 3)
    reference = stored_reference(job, data, LR)
    torch32 = torch_reference(job, data, LR, dtype=torch.float32)
    ours = parallel_run(job, Topology.single(), data, LR)
    failures = reference.check("torch fp32", torch32.losses, torch32.grad_norms, torch32.state)
    failures += reference.check("llmtrain fp32", ours["losses"], ours["grad_norms"], ours["state"])
    assert not failures, "\n".join(failures)
