"""train.precision=fp8 through torchao's float8 training, on CPU: forward and loss curve against bf16.

References: the same model in bf16 (torch's own GEMMs), from the same weights and batches. The fp8 model
differs only in the blocks' linear layers, whose inputs and weights torchao rounds to e4m3 (3 mantissa
bits: relative rounding error up to 2^-4 per operand) and whose output gradients it rounds to e5m2.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from llmtrain import models
from llmtrain.config import ConfigError, validate
from llmtrain.config.engine_rules import float8_all_gather
from llmtrain.parallel import Topology
from llmtrain.parallel.float8 import apply_float8
from tests.parallel._dist import batches, parallel_run, tiny_job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")

STEPS = 8
# Worst case of one product of two e4m3-rounded operands: (1 + 2^-4)^2 - 1 = 0.129. A dot product of such
# products has at most that relative error when its terms share a sign and far less otherwise (the
# rounding errors are independent); the logits of the 2-layer model measured 4.2%.
LOGITS_BOUND = 0.13
# The loss is a mean over the 32 tokens of a micro-batch of a smooth function of those logits, which
# averages the independent rounding errors: over 20 steps at lr 3e-3 the fp8 curve stayed within 0.7% of
# bf16's (measured; bf16 vs fp32 0.1%). 2^-5 = 3.1% leaves 4x margin; a mis-scaled float8 GEMM (a wrong or
# missing scale factor) moves the loss by O(1).
LOSS_BOUND = 2**-5


def _float8_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


@pytest.mark.slow  # importing torchao's float8 path pulls in torch._inductor: tens of seconds on a busy CPU
def test_conversion_swaps_block_linears_only_and_forward_tracks_bf16() -> None:
    job = tiny_job("llama", precision="fp8")
    torch.manual_seed(0)
    bf16 = models.build(job.model).to(torch.bfloat16)
    fp8 = apply_float8(copy.deepcopy(bf16), Topology.single(), job.train)
    converted = _float8_modules(fp8)
    # q, k, v, o, gate_up and down in each of the 2 blocks; the LM head stays bf16.
    assert len(converted) == 12 and all(name.startswith("layers.") for name in converted), converted
    assert type(fp8.lm_head) is nn.Linear
    ids = batches(job, 1)[0][:, :-1]
    with torch.no_grad():
        expected, got = bf16(ids).double(), fp8(ids).double()
    gap = ((got - expected).norm() / expected.norm()).item()
    # Above bf16 rounding (the bf16 model run twice is bit-identical): float8 rounding really happened.
    assert 2**-8 < gap < LOGITS_BOUND, gap


@pytest.mark.slow
def test_fp8_loss_curve_tracks_bf16() -> None:
    curves, runs = {}, {}
    for precision in ("bf16", "fp8"):
        job = tiny_job("llama", precision=precision)
        job.train.global_batch_size = 4
        runs[precision] = parallel_run(job, Topology.single(), batches(job, STEPS, learnable=True), lr=3e-3)
        curves[precision] = runs[precision]["losses"]
    fp8 = runs["fp8"]
    assert len(_float8_modules(fp8["model"])) == 12
    # Master weights fp32 and parameters bf16, as bf16 training keeps them.
    assert {m.dtype for m in fp8["opt"].masters} == {torch.float32}
    assert {p.dtype for p in fp8["model"].parameters()} == {torch.bfloat16}
    gaps = [abs(a - b) / b for a, b in zip(curves["fp8"], curves["bf16"], strict=True)]
    assert max(gaps) < LOSS_BOUND, (curves, gaps)
    assert curves["fp8"][-1] < curves["fp8"][0] - 0.5, curves["fp8"]  # and it learns


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(hidden_size=72, num_attention_heads=4), "model.hidden_size to be a multiple of 16"),
        # ffn 192 over tp=4: 48 a rank is fine, over tp=8 (8 heads of 8) 24 is not.
        (dict(tp=8, num_attention_heads=8), r"model.num_attention_heads x head size / parallel.tp"),
        (dict(cp=2, micro_batch_size=1), r"got 8;"),  # 16 tokens over 2 CP ranks
        (dict(seq_length=15), r"micro_batch_size x model.seq_length / parallel.cp \(tokens per GEMM\)"),
        # The float8 weight all-gather: one tensorwise scale over the whole weight, gathered by ZeRO-3.
        (dict(fp8_all_gather=True, dp=2, zero_stage=1), r"needs parallel.zero_stage=3 \(got 1\)"),
        (dict(fp8_all_gather=True, dp=2, zero_stage=3, fp8_recipe="rowwise"), r"fp8_recipe=tensorwise"),
        (dict(fp8_all_gather=True, tp=2, dp=2, zero_stage=3), r"needs parallel.tp=1 \(got 2\)"),
    ],
)
def test_unsupported_fp8_layouts_are_rejected_at_config_time(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_job("llama", precision="fp8", **overrides))


def test_fp8_all_gather_needs_fp8() -> None:
    with pytest.raises(
        ConfigError, match=r"train.fp8_all_gather=true .* needs train.precision=fp8 \(got bf16\)"
    ):
        validate(tiny_job("llama", precision="bf16", fp8_all_gather=True, dp=2, zero_stage=3))


def test_fp8_all_gather_defaults_on_where_it_applies() -> None:
    # torchtitan's recipe: tensorwise float8 under FSDP2 gathers in float8; off elsewhere, or when asked.
    def on(**overrides: object) -> bool:
        return float8_all_gather(tiny_job("llama", precision="fp8", **overrides))

    assert on(dp=2, zero_stage=3)
    assert not on(dp=2, zero_stage=3, fp8_all_gather=False)
    assert not on(dp=2, zero_stage=3, fp8_recipe="rowwise")
    assert not on(dp=2, zero_stage=2)
    assert not on(tp=2, dp=2, zero_stage=3)


def test_fp8_without_torchao_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs torchao \(pip install 'llmtrain\[fp8\]'\)"):
        validate(tiny_job("llama", precision="fp8"))


def test_startup_block_names_the_recipe_the_float8_gather_and_the_experts_fallback() -> None:
    from llmtrain.training.run import _float8_note

    dense = tiny_job("llama", precision="fp8", dp=2, zero_stage=3)
    cpu = torch.device("cpu")
    assert _float8_note(dense, cpu) == " (recipe tensorwise; ZeRO-3 weight all-gather in float8)"
    moe = tiny_job("mixtral", precision="fp8", fp8_recipe="rowwise")
    assert _float8_note(moe, cpu) == (
        " (recipe rowwise; routed experts' grouped GEMM in bf16 (the fallback), train.fp8_grouped_mm=auto)"
    )
    moe.train.fp8_grouped_mm = "mxfp8"
    assert _float8_note(moe, cpu) == (
        " (recipe rowwise; routed experts' grouped GEMM in MXFP8, train.fp8_grouped_mm=mxfp8)"
    )
    assert _float8_note(tiny_job("llama", precision="bf16"), cpu) == ""
