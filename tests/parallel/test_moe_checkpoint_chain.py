"""A mixture-of-experts run resumed along a chain of layouts over gloo (4 processes): saved at ep=4 (ZeRO-1),
resumed at ep=2 with another TP degree and ZeRO-3, at ep=1 with pipeline stages and ZeRO-2, and back at ep=4
with the EP group spanning TP ranks and no ZeRO. Every layout change moves the experts (and their Adam
moments) to other ranks; ERNIE-4.5-MoE adds a shared expert and the router's score bias, a frozen parameter
no optimizer holds, and Qwen3-MoE the QK-norm weights every TP rank holds (one writes them; their gradient is
summed over TP).

References: the uninterrupted one-process run (losses and gradient norms of every step) and the checkpoint
each segment resumed from (re-saved by the loading layout before its first step, it holds bitwise the same
model and optimizer tensors, gathered to full tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain.checkpoint import Checkpointer
from llmtrain.checkpoint.convert import read_full
from llmtrain.config import JobConfig
from llmtrain.models.moe import Router
from llmtrain.parallel import Topology
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job

WORLD = 4
LR = 1e-3
SEGMENT = 2  # steps each layout trains before it saves
# (ep, tp, pp, zero_stage) of each segment; dp is what the other degrees leave of the 4 ranks.
CHAIN = [(4, 1, 1, 1), (2, 2, 1, 3), (1, 1, 2, 2), (4, 2, 1, 0)]
STEPS = SEGMENT * len(CHAIN)
# Model overrides of tests.parallel._dist's tiny mixtral (4 experts, top-2, no load-balancing loss). Mixtral
# itself has no chain of its own: Qwen3-MoE is it (llmtrain.models.registry: the same norm, MLP, rotary
# and, from this ModelConfig, the same experts and router) plus the QK-norm, so its chain moves every tensor
# a Mixtral chain would, and ERNIE's all of them but the QK-norm.
MODELS = {
    "ernie_moe": dict(num_shared_experts=1, moe_ffn_hidden_size=32),
    "qwen3_moe": {},
}
# Relative gap of losses and gradient norms to the uninterrupted one-process run: see the test's docstring.
RTOL = 1e-6


def _job(arch: str, ep: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0) -> JobConfig:
    job = tiny_job("mixtral", **MODELS[arch], ep=ep, tp=tp, pp=pp, zero_stage=zero_stage)
    job.model.arch = arch
    job.checkpoint.keep = 2 * len(CHAIN)  # every save stays, for the comparisons at the end
    return job


@torch.no_grad()
def _bias_routers(model: Any) -> None:
    """Give every score bias distinct values, so that a bias loaded into the wrong layer or expert, or left
    at its initial zeros, routes tokens to other experts."""
    for i, router in enumerate(m for m in model.modules() if isinstance(m, Router)):
        if router.score_bias is not None:
            bias = router.score_bias
            bias.copy_(0.01 * torch.arange(bias.numel(), dtype=bias.dtype).roll(i) - 0.015)


def _chain(rank: int, world: int, root: Path, arch: str) -> dict[str, Any]:
    """Train `arch` along CHAIN, saving under `root`; the losses and gradient norms of every step, and (on
    rank 0) the tensors that differ between a checkpoint and its re-save by the layout that loaded it."""
    data = batches(_job(arch), STEPS)
    losses: list[float] = []
    norms: list[float] = []
    for k, (ep, tp, pp, zero) in enumerate(CHAIN):
        job = _job(arch, ep, tp, pp, zero)
        job.output_dir = str(root / f"segment{k}")
        topo = Topology(job.parallel, world, rank)
        checkpointer = Checkpointer(job, topo)
        first = k * SEGMENT

        def resume(
            model: Any, opt: Any, k: int = k, first: int = first, ck: Checkpointer = checkpointer
        ) -> None:
            if k == 0:
                _bias_routers(model)
                return
            ck.load(root / f"segment{k - 1}" / "checkpoints", model, opt)
            ck.save(first, model, opt, {"step": first})  # what this layout loaded, for the comparison

        run = parallel_run(job, topo, data[first : first + SEGMENT], LR, resume=resume)
        checkpointer.save(first + SEGMENT, run["model"], run["opt"], {"step": first + SEGMENT})
        losses += run["losses"]
        norms += run["grad_norms"]
    differ = []
    if rank == 0:
        for k in range(1, len(CHAIN)):
            step = f"step_{k * SEGMENT}"
            saved = read_full(root / f"segment{k - 1}" / "checkpoints" / step)
            loaded = read_full(root / f"segment{k}" / "checkpoints" / step)
            assert saved.keys() == loaded.keys(), sorted(saved.keys() ^ loaded.keys())
            assert any(".experts." in key and key.endswith("exp_avg_sq") for key in saved)
            differ += [f"{CHAIN[k]}: {key}" for key in saved if not torch.equal(saved[key], loaded[key])]
    return {"losses": losses, "grad_norms": norms, "differ": differ}


def _chains(rank: int, world: int, tmp: str) -> dict[str, dict[str, Any]]:
    # One launch for every model: process start-up dominates on a shared CPU.
    return {arch: _chain(rank, world, Path(tmp) / arch, arch) for arch in MODELS}


@pytest.mark.slow
def test_moe_checkpoint_reshards_across_ep_tp_pp_and_zero(tmp_path: Path) -> None:
    """After every resume the losses and gradient norms are those of the uninterrupted one-process run up
    to fp32 summation order, and the loaded state is bitwise the saved one.

    Tolerance: every layout computes the same fp32 functions of the same inputs in another summation order
    (TP splits the hidden and FFN sums, EP and DP the batch sums, ZeRO reduce-scatters where ZeRO-1
    all-reduces), so the runs differ by fp32 rounding only: u = 6e-8 per operation, ~sqrt(N) u for sums of N
    <= 8 * 16 * 128 terms, which Adam's normalised step at lr 1e-3 turns into weight differences of ~1e-9
    to 1e-8 and the next losses and norms into ~1e-7 relative (measured: at most 5e-8 on the losses, 1.3e-7
    on the norms). RTOL = 1e-6 leaves a margin; a resume without the optimizer state misses it by 1.7e-4 to
    3e-2 on the next steps, ERNIE's score bias at zeros by 6e-5 on the losses and 3e-3 on the norms, QK-norm
    gradients not summed over TP by 7e-5 (all tried); the loaded state itself is compared exactly.
    """
    results = spawn(WORLD, _chains, str(tmp_path))[0]
    for arch, got in results.items():
        assert not got["differ"], "\n".join(got["differ"])
        job = _job(arch)
        reference = parallel_run(job, Topology.single(), batches(job, STEPS), LR, setup=_bias_routers)
        for name in ("losses", "grad_norms"):
            torch.testing.assert_close(
                torch.tensor(got[name], dtype=torch.float64),
                torch.tensor(reference[name], dtype=torch.float64),
                rtol=RTOL,
                atol=0.0,
                msg=lambda m, arch=arch, name=name: f"{arch} {name} along {CHAIN}: {m}",
            )
