"""TP / SP / DP / ZeRO-1 layouts train exactly like one process (reference: plain model + torch AdamW)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.parallel import Topology
from tests.parallel._dist import parallel_run, reference_run, spawn, tiny_job

STEPS = 5
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2)]}


def _cases(world: int) -> list[tuple[str, int, int, bool, int]]:
    return [
        (arch, tp, dp, sp, zero)
        for arch in ("gpt", "llama", "ernie")
        for tp, dp in LAYOUTS[world]
        for sp in ((False, True) if tp > 1 else (False,))
        for zero in (0, 1)
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


def _compare(rank: int, world: int) -> dict:
    facts = _topology_facts(rank, world) if world == 4 else None
    failures = []
    references = {}
    for arch, tp, dp, sp, zero in _cases(world):
        job = tiny_job(arch, tp=tp, dp=dp, sequence_parallel=sp, zero_stage=zero)
        topo = Topology(job.parallel, world, rank)
        run = parallel_run(job, topo, STEPS)
        if rank != 0:
            continue
        if arch not in references:
            references[arch] = reference_run(job, STEPS)
        ref_losses, ref_state = references[arch]
        name = f"{arch} tp={tp} dp={dp} sp={sp} zero={zero}"
        rel = abs(run["losses"][-1] - ref_losses[-1]) / abs(ref_losses[-1])
        if rel > 1e-5:
            failures.append(f"{name}: loss {run['losses']} vs {ref_losses} (rel {rel:.2e})")
        if set(run["state"]) != set(ref_state):
            failures.append(f"{name}: names differ {set(run['state']) ^ set(ref_state)}")
            continue
        worst = max((run["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
        if worst > 1e-5:
            failures.append(f"{name}: gathered weights differ by {worst:.2e}")
        if any(s.skipped for s in run["stats"]):
            failures.append(f"{name}: skipped steps")
    return {"failures": failures, "topology": facts}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world: int) -> None:
    results = spawn(world, _compare)
    failures = results[0]["failures"]
    assert not failures, "\n".join(failures)
    if world == 4:
        _check_topology([r["topology"] for r in results])


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


def test_single_process_stack_matches_torch() -> None:
    job = tiny_job("llama")
    ref_losses, ref_state = reference_run(job, 3)
    run = parallel_run(job, Topology.single(), 3)
    torch.testing.assert_close(run["losses"], ref_losses, rtol=1e-6, atol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(run["state"][k], v, rtol=0, atol=1e-6)
