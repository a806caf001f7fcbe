"""ZeRO-2/3 with the embedding and output layer vocabulary-sharded (llmtrain.parallel.vocab_sharded) train
like one process, and never gather either vocabulary-sized weight.

The reference and bounds are test_fsdp.py's: the float64 one-process run, the fp32 bounds derived from it,
and a worst relative gap of 1e-4 over losses and gradient norms (its docstring argues that figure from
fp32 rounding over these reductions). ZeRO-3 and ZeRO-2 on 4 ranks, 2 micro-batches each (gradients
accumulated in the sharded rows across unsynchronised micro-batches).

The negative control runs ZeRO-3 with the gradient factors of the module docstring dropped (hidden
gradient not multiplied by n, embedding rows not divided by n): those gradients are off by n and must
fail the same bounds, so the bounds see the factors.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from llmtrain.config import JobConfig
from llmtrain.parallel import Topology
from llmtrain.parallel import vocab_sharded as vs
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job
from tests.parallel._reference import Reference, torch_reference, worst_gap

STEPS = 3
LR = 1e-3
WORST_RELATIVE_GAP = 1e-4
CASES = [dict(zero_stage=3, dp=4), dict(zero_stage=2, dp=4)]


def _job(overrides: dict) -> JobConfig:
    job = tiny_job("llama", **overrides)
    job.train.global_batch_size = 16
    return job


def _count_module_calls(model: torch.nn.Module) -> dict[str, int]:
    """Forward calls of the embedding and output layer as modules (FSDP gathers a unit only for those)."""
    calls = {"embed_tokens": 0, "lm_head": 0}
    for name in calls:

        def hook(module: torch.nn.Module, args: object, name: str = name) -> None:
            calls[name] += 1

        getattr(model, name).register_forward_pre_hook(hook)
    return calls


def _worker(rank: int, world: int) -> dict:
    out: dict = {"runs": [], "unscaled": None}
    calls: dict[str, int] = {}

    def setup(model: torch.nn.Module) -> None:
        calls.update(sharded=model.vocab_sharded is not None)
        calls.update(_count_module_calls(model))

    for overrides in CASES:
        job = _job(overrides)
        topo = Topology(job.parallel, world, rank)
        run = parallel_run(job, topo, batches(job, STEPS), LR, setup=setup)
        out["runs"].append({k: run[k] for k in ("losses", "grad_norms", "state")} | {"calls": dict(calls)})
    job = _job(CASES[0])
    with mock.patch.object(vs._ScaleGrad, "apply", lambda x, factor: x):
        run = parallel_run(job, Topology(job.parallel, world, rank), batches(job, STEPS), LR)
    out["unscaled"] = {k: run[k] for k in ("losses", "grad_norms", "state")}
    return out


@functools.cache
def _results() -> list[dict]:
    return spawn(4, _worker)


@functools.cache
def _reference() -> Reference:
    """The float64 one-process run, once: every case and the unscaled run train the same model on the same
    batches (zero_stage and dp are the layout, which the reference has none of)."""
    job = _job(CASES[0])
    return torch_reference(job, batches(job, STEPS), LR)


@pytest.mark.slow
def test_vocab_sharded_layouts_match_single_process_without_gathering() -> None:
    failures = []
    for index, overrides in enumerate(CASES):
        reference = _reference()
        for rank, result in enumerate(_results()):
            run = result["runs"][index]
            name = f"{overrides} rank {rank}"
            assert run["calls"] == {"sharded": True, "embed_tokens": 0, "lm_head": 0}, (name, run["calls"])
            failures += reference.check(name, run["losses"], run["grad_norms"], run["state"])
            gap = worst_gap(run["losses"] + run["grad_norms"], reference.losses + reference.grad_norms)
            print(f"{name}: worst relative gap to float64 {gap:.2e}")  # shown with pytest -s
            if not gap <= WORST_RELATIVE_GAP:
                failures.append(f"{name}: worst relative gap {gap:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_vocab_sharded_gradient_factors_are_needed() -> None:
    reference = _reference()
    run = _results()[0]["unscaled"]
    assert reference.check("unscaled", run["losses"], run["grad_norms"], run["state"])
