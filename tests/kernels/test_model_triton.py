"""Whole models with model.kernels=triton vs the same weights with kernels=torch and vs transformers.

References: the PyTorch kernel path (kernels/reference.py) and transformers' GPT2LMHeadModel,
LlamaForCausalLM, Ernie4_5ForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM
(tests/models/hf_models.py), in fp32.
Tolerance 2e-5 absolute and relative: the Triton kernels reorder fp32 sums (online softmax, blocked
reductions), nothing more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.attention
import kernels.glu
import kernels.grouped_gemm
import kernels.loss
import kernels.norms
import kernels.rotary
from llmtrain.models import from_hf_config
from llmtrain.models.hf import hf_to_llmtrain_state, model_from_state
from tests.kernels.conftest import DEVICE
from tests.models.hf_models import MOE_ARCHS, hf_model

TOL = dict(atol=2e-5, rtol=2e-5)
# One GQA config per dense architecture (index 0), plus ERNIE's MQA one, and Qwen3-MoE (its q/k norms run
# the RMSNorm kernel on 4-D heads, its experts the grouped GEMM and the SwiGLU kernel on row slices), and
# DeepSeek-V3's latent attention (its zero-padded q/k, explicit softmax scale and latent norms): the
# interpreter is slow. Qwen3-MoE's config 1 (one MoE layer of 3 experts, hidden 64, between dense ones)
# reaches the same kernels as config 0 (two MoE layers of 5 experts, hidden 96) with a sixth of the grouped
# GEMM's programs, which made the MoE cases two thirds of this file's time; how top-k slots combine is torch
# code, the same under both kernel settings and checked against transformers in tests/models.
CASES = [("gpt", 0), ("llama", 0), ("ernie", 0), ("ernie", 2), ("qwen3_moe", 1), ("deepseek_v3", 1)]


def _run(model, ids, labels):
    logits = model(ids)
    loss = model.loss(logits, labels)
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "index"), CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_triton_kernels_match_torch_kernels_and_transformers(arch: str, index: int, monkeypatch) -> None:
    # Count calls into the Triton entry points, so the test fails if the model never reaches them.
    calls: dict[str, int] = {}
    modules = (
        kernels.attention,
        kernels.glu,
        kernels.grouped_gemm,
        kernels.loss,
        kernels.norms,
        kernels.rotary,
    )
    names = (
        "flash_attention",
        "swiglu",
        "grouped_mm",
        "cross_entropy",
        "rms_norm",
        "layer_norm",
        "apply_rotary",
    )
    for module in modules:
        for name in names:
            if hasattr(module, name):
                fn = getattr(module, name)

                def spy(*args, _fn=fn, _name=name, **kwargs):
                    calls[_name] = calls.get(_name, 0) + 1
                    return _fn(*args, **kwargs)

                monkeypatch.setattr(module, name, spy)
    ref = hf_model(arch, index).to(DEVICE).train()
    cfg = from_hf_config(ref.config)
    state = hf_to_llmtrain_state(cfg, ref.state_dict())
    ours = {
        impl: model_from_state(dataclasses.replace(cfg, kernels=impl), state, DEVICE).train()
        for impl in ("torch", "triton")
    }

    # 2 sequences of 7 tokens: the batch dimension stays (a model that mixed batch and sequence up on the
    # way into a kernel shows only with 2), and 7 is a ragged tail of every kernel's first block as 13 was
    # (the interpreted attention takes 16 keys and queries per block). The interpreter's cost is per program
    # and rotary runs one per token: it took a third of a case at 13 tokens (cProfile, llama-0).
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(index))
    ids = ids.to(DEVICE)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100, device=DEVICE)], dim=1)
    tri_logits, tri_loss, tri_grads = _run(ours["triton"], ids, labels)
    expected_calls = (
        {"flash_attention", "cross_entropy"}
        | ({"layer_norm"} if arch == "gpt" else {"rms_norm", "swiglu", "apply_rotary"})
        | ({"grouped_mm"} if arch in MOE_ARCHS else set())
    )
    assert expected_calls <= set(calls), f"Triton kernels not reached: {expected_calls - set(calls)}"
    torch_logits, torch_loss, torch_grads = _run(ours["torch"], ids, labels)
    # transformers shifts the labels inside; a mixture of experts adds its load-balancing loss, as ours does.
    out = ref(input_ids=ids, labels=ids, **({"output_router_logits": True} if arch in MOE_ARCHS else {}))
    out.loss.backward()
    # Frozen tensors (DeepSeek's router score bias, a buffer in transformers) have no gradient: zeros map.
    grads = {n: p.grad for n, p in ref.named_parameters()}
    hf_state = {n: grads.get(n, torch.zeros_like(t)) for n, t in ref.state_dict().items()}
    frozen = {n for n, p in ours["triton"].named_parameters() if not p.requires_grad}
    hf_grads = {n: g for n, g in hf_to_llmtrain_state(cfg, hf_state).items() if n not in frozen}

    for expected_logits, expected_loss, expected_grads, what in (
        (torch_logits, torch_loss, torch_grads, "kernels=torch"),
        (out.logits, out.loss, hf_grads, "transformers"),
    ):
        torch.testing.assert_close(
            tri_logits, expected_logits, **TOL, msg=lambda m, w=what: f"logits vs {w}: {m}"
        )
        torch.testing.assert_close(tri_loss, expected_loss, **TOL, msg=lambda m, w=what: f"loss vs {w}: {m}")
        assert sorted(tri_grads) == sorted(expected_grads)
        for name, grad in tri_grads.items():
            torch.testing.assert_close(
                grad, expected_grads[name], **TOL, msg=lambda m, n=name, w=what: f"grad {n} vs {w}: {m}"
            )
