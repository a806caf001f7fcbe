"""Reference: transformers' GPT2LMHeadModel, LlamaForCausalLM and Ernie4_5ForCausalLM.

Each llmtrain architecture, loaded with the transformers model's weights through the conversion
mapping, must give the same logits, loss and parameter gradients within 1e-5 in fp32.
`assert_matches_transformers` is importable so the kernel tests can rerun it with kernels="triton".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmtrain.models import from_hf_config
from llmtrain.models.hf import hf_to_llmtrain_state, model_from_state
from tests.models.hf_models import CONFIGS, hf_model

CASES = [(arch, i) for arch, configs in CONFIGS.items() for i in range(len(configs))]


def assert_matches_transformers(
    arch: str, index: int, kernels: str = "auto", atol: float = 1e-5, rtol: float = 1e-5, seq: int = 13
) -> None:
    """Logits, loss and every parameter gradient of CONFIGS[arch][index] equal transformers' (fp32)."""
    tol = dict(atol=atol, rtol=rtol)
    ref = hf_model(arch, index).train()
    cfg = dataclasses.replace(from_hf_config(ref.config), kernels=kernels)
    assert cfg.arch == arch
    ours = model_from_state(cfg, hf_to_llmtrain_state(cfg, ref.state_dict())).train()
    assert ours.config.tied_embeddings == ref.config.tie_word_embeddings

    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(index))
    out = ref(input_ids=ids, labels=ids)  # transformers shifts the labels inside
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    logits = ours(ids)
    loss = ours.loss(logits, labels)
    torch.testing.assert_close(logits, out.logits, **tol)
    torch.testing.assert_close(loss, out.loss, **tol)

    out.loss.backward()
    loss.backward()
    # The gradients go through the same mapping as the weights (transposes, splits, fusions).
    expected = hf_to_llmtrain_state(cfg, {name: p.grad for name, p in ref.named_parameters()})
    grads = {name: p.grad for name, p in ours.named_parameters()}
    assert sorted(grads) == sorted(expected)
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("arch", "index"), CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_logits_loss_and_gradients_match_transformers(arch: str, index: int) -> None:
    assert_matches_transformers(arch, index, kernels="torch")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_forward_with_labels_equals_pipeline_pieces(arch: str) -> None:
    """forward(ids, labels) == embed -> rope -> layers -> head -> loss, the path pipeline stages take."""
    ref = hf_model(arch, 0)
    cfg = from_hf_config(ref.config)
    model = model_from_state(cfg, hf_to_llmtrain_state(cfg, ref.state_dict()))
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    x = model.embed(ids)
    rope = model.rope(ids.shape[1], x.device, x.dtype)
    for layer in model.layers:
        x = layer(x, rope)
    by_pieces = model.loss(model.head(x), ids)
    assert torch.equal(by_pieces, model(ids, labels=ids))
    ref_logits = ref(input_ids=ids).logits
    expected = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), ids.flatten())
    torch.testing.assert_close(by_pieces, expected, atol=1e-5, rtol=1e-5)
