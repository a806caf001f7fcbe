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


def _compare(rank: int, world: int) -> list[str]:
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
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world: int) -> None:
    failures = spawn(world, _compare)[0]
    assert not failures, "\n".join(failures)


def test_single_process_stack_matches_torch() -> None:
    job = tiny_job("llama")
    ref_losses, ref_state = reference_run(job, 3)
    run = parallel_run(job, Topology.single(), 3)
    torch.testing.assert_close(run["losses"], ref_losses, rtol=1e-6, atol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(run["state"][k], v, rtol=0, atol=1e-6)
