"""The routed experts' grouped GEMM in float8 (train.fp8_grouped_mm, llmtrain.parallel.float8_experts).

MXFP8 runs here (torchao's emulation on CPU: its quantisation, then the dequantised products), so that is
what is checked; rowwise needs torch._scaled_grouped_mm on a Hopper GPU.

One layer against float64. MXFP8 stores each element in e4m3 (3 mantissa bits) with one power-of-2 scale
per block of 32 along the reduction dimension, chosen so the block's largest element fits e4m3 (RCEIL):
every element of normal range is rounded to the nearest of 8 steps per binade, an error of at most 2^-4 of
its magnitude and, spread evenly over a step, an RMS of 2^-4/sqrt(3) ~= 0.036. A product of two such
operands carries both, ~0.051 RMS per term; summed over K terms of random sign, the error and the result
both grow as sqrt(K), so the output's relative (Frobenius) error stays ~0.05, whatever K. The experts chain
two GEMMs (gate_up, then down through SwiGLU), and a gradient is a third: at most ~sqrt(3) x 0.05 ~= 0.09.
Bound: 2^-3 = 0.125 relative, for the output and every gradient. Control: bf16's own error (2^-8 roundings)
is over 10x smaller, and the float8 path must sit above 4x it -- the float8 kernels did run.

Expert parallelism. Under ep=2 each rank's experts quantise the rows routed to them: the forward and
input-gradient GEMMs scale blocks along the hidden/ffn dimension of each row, as one process does; the
weight gradient scales blocks of 32 along the tokens, which EP concatenates in another order (by source
rank), so its float8 operands differ from one process's by float8 rounding -- an effect of the recipe.
As tests/parallel/test_float8_layouts.py argues for every layout: loss, gradient norm and weights after
the steps may sit from the one-process MXFP8 run at most twice as far as that run sits from one-process
bf16; a weight gradient left unreduced or a wrong scale moves them by O(1).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch

from llmtrain.config import ConfigError, ModelConfig, validate
from llmtrain.models.moe import Experts
from llmtrain.parallel import Topology
from llmtrain.parallel.float8_experts import (
    Float8GroupedMM,
    grouped_mm_device_problem,
    resolve_grouped_mm,
    torchao_config,
)
from tests.parallel._dist import SpawnedCases, batches, parallel_run, tiny_job
from tests.parallel.test_float8_layouts import _gaps, _summary

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")

BOUND = 2.0**-3  # MXFP8's relative error through the experts' GEMMs (module docstring)
STEPS = 3
LR = 1e-3
GAP_VS_ROUNDING = 2.0
EP_JOB = dict(ep=2, dp=2, fp8_grouped_mm="mxfp8", num_experts=4, moe_ffn_hidden_size=64)


def _reference(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU experts in float64, one expert's rows at a time."""
    outs = []
    for e, rows in enumerate(x.double().split(counts)):
        g, u = (rows @ gate_up[e].double().t()).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(g) * u) @ down[e].double().t())
    return torch.cat(outs)


def _experts_gaps(grouped: Float8GroupedMM | None) -> dict[str, float]:
    """Relative gaps to float64 of the experts' output and gradients, float8 (``grouped``) or bf16."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="mixtral", hidden_size=64, num_experts=4, moe_ffn_hidden_size=96, kernels="torch")
    experts = Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn_like(experts.gate_up_proj) / 8)
        experts.down_proj.copy_(torch.randn_like(experts.down_proj) / 10)
    experts.to(torch.bfloat16).grouped_mm = grouped
    counts = [40, 0, 7, 33]  # an expert without tokens, groups off the 32-row blocks (padded)
    x = torch.randn(sum(counts), 64).to(torch.bfloat16).requires_grad_()
    g = torch.randn(sum(counts), 64).to(torch.bfloat16)
    out = experts.compute(x, counts)
    out.backward(g)
    params = (experts.gate_up_proj, experts.down_proj)
    leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
    ref = _reference(leaves[0], counts, leaves[1], leaves[2])
    ref.backward(g.double())

    def gap(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want).norm() / want.norm()).item()

    return {
        "output": gap(out, ref),
        "input grad": gap(x.grad, leaves[0].grad),
        "gate_up grad": gap(experts.gate_up_proj.grad, leaves[1].grad),
        "down grad": gap(experts.down_proj.grad, leaves[2].grad),
    }


@pytest.mark.slow  # torchao's import and its emulated MXFP8: seconds
def test_mxfp8_experts_match_float64_within_mxfp8_rounding() -> None:
    mxfp8 = _experts_gaps(Float8GroupedMM(torchao_config("mxfp8", "cpu"), "torch"))
    bf16 = _experts_gaps(None)
    print(f"\nmxfp8 {mxfp8}\nbf16 {bf16}")
    for name, gap in mxfp8.items():
        assert gap < BOUND, f"{name}: {gap:.3e} >= {BOUND}"
        assert bf16[name] * 10 < BOUND, f"bf16 {name}: {bf16[name]:.3e}"
        assert gap > 4 * bf16[name], f"{name}: {gap:.3e} is bf16's rounding: float8 did not run"


def test_impossible_grouped_gemms_are_refused_in_one_line() -> None:
    job = tiny_job("mixtral", precision="fp8", fp8_grouped_mm="mxfp8", moe_ffn_hidden_size=48)
    with pytest.raises(
        ConfigError, match=r"^train.fp8_grouped_mm=mxfp8 needs model.moe_ffn_hidden_size .* of 32"
    ):
        validate(job)
    job.train.fp8_grouped_mm = "rowwise"  # 48 is a multiple of rowwise's 16
    validate(job)
    assert "needs torch._scaled_grouped_mm on a CUDA device" in grouped_mm_device_problem("rowwise", "cpu")
    assert resolve_grouped_mm("auto", "cpu", job.model) == "bf16"
    assert resolve_grouped_mm("mxfp8", "cpu", job.model) == "mxfp8"


@functools.cache
def _one_process() -> dict[str, dict]:
    runs = {}
    for precision in ("fp8", "bf16"):
        job = tiny_job("mixtral", precision=precision, **EP_JOB | dict(ep=1, dp=1))
        runs[precision] = _summary(
            parallel_run(job, Topology.single(), batches(job, STEPS, learnable=True), LR)
        )
    return runs


def _ep_run(rank: int, world: int) -> dict | None:
    job = tiny_job("mixtral", precision="fp8", **EP_JOB)
    run = parallel_run(job, Topology(job.parallel, world, rank), batches(job, STEPS, learnable=True), LR)
    assert all(
        isinstance(m.grouped_mm, Float8GroupedMM) for m in run["model"].modules() if isinstance(m, Experts)
    )
    if rank != 0:
        return None
    return {"run": _summary(run), **_one_process()}


def _case(rank: int, world: int) -> Any:
    return _ep_run(rank, world)


@pytest.mark.slow
def test_mxfp8_experts_under_ep2_train_like_one_mxfp8_process() -> None:
    r = SpawnedCases(_case, {"ep2": (2, ())})("ep2")[0]
    layout, rounding = _gaps(r["run"], r["fp8"]), _gaps(r["fp8"], r["bf16"])
    print(f"\nep=2 mxfp8: vs one mxfp8 process {layout}; mxfp8 vs bf16 {rounding}")
    for key, gap in layout.items():
        assert gap <= GAP_VS_ROUNDING * rounding[key], (
            f"{key} {gap:.2e} > {GAP_VS_ROUNDING} x {rounding[key]:.2e}"
        )
