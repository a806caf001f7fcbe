"""Reference: transformers' GPT2LMHeadModel, LlamaForCausalLM, Ernie4_5ForCausalLM, MixtralForCausalLM,
Qwen3MoeForCausalLM, Ernie4_5_MoeForCausalLM and DeepseekV3ForCausalLM.

Each llmtrain architecture, loaded with the transformers model's weights through the conversion
mapping, must give the same logits, loss and parameter gradients within 1e-5 in fp32. For the mixtures of
experts the loss is transformers' with output_router_logits=True: cross-entropy plus router_aux_loss_coef
times its load_balancing_loss_func, so the router's gradient through the aux loss is checked too.
`assert_matches_transformers` is importable so the kernel tests can rerun it with kernels="triton".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmtrain.models import from_hf_config
from llmtrain.models.hf import hf_to_llmtrain_state, model_from_state
from tests.models.hf_models import AUX_LOSS_ARCHS, CONFIGS, MOE_ARCHS, hf_model

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
    moe = {"output_router_logits": True} if arch in MOE_ARCHS else {}
    out = ref(input_ids=ids, labels=ids, **moe)  # transformers shifts the labels inside
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    logits = ours(ids)
    loss = ours.loss(logits, labels)
    torch.testing.assert_close(logits, out.logits, **tol)
    torch.testing.assert_close(loss, out.loss, **tol)

    out.loss.backward()
    loss.backward()
    # The gradients go through the same mapping as the weights (transposes, splits, fusions). Frozen
    # tensors (ERNIE's router score bias, DeepSeek's buffer) have none on either side: zeros stand in.
    grads = {name: p.grad for name, p in ref.named_parameters() if p.requires_grad}
    expected = hf_to_llmtrain_state(
        cfg, {name: grads.get(name, torch.zeros_like(t)) for name, t in ref.state_dict().items()}
    )
    frozen = {name for name, p in ours.named_parameters() if not p.requires_grad}
    assert all(ours.get_parameter(name).grad is None for name in frozen)
    grads = {name: p.grad for name, p in ours.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(set(expected) - frozen)
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
    moe = arch in AUX_LOSS_ARCHS
    ref_out = ref(input_ids=ids, output_router_logits=True) if moe else ref(input_ids=ids)
    expected = torch.nn.functional.cross_entropy(ref_out.logits.flatten(0, 1), ids.flatten())
    if moe:  # a model in training mode adds the load-balancing loss, as transformers does
        expected = expected + ref.config.router_aux_loss_coef * ref_out.aux_loss
    torch.testing.assert_close(by_pieces, expected, atol=1e-5, rtol=1e-5)


MOE_CASES = [(arch, i) for arch in AUX_LOSS_ARCHS for i in range(len(CONFIGS[arch]))]


@pytest.mark.parametrize(("arch", "index"), MOE_CASES, ids=[f"{a}-{i}" for a, i in MOE_CASES])
def test_aux_loss_and_its_gradient_match_transformers(arch: str, index: int) -> None:
    """The load-balancing loss alone equals transformers' aux_loss, and so does the router gradient it
    gives; evaluation reports the cross-entropy alone (transformers' loss without router logits)."""
    ref = hf_model(arch, index).train()
    cfg = from_hf_config(ref.config)
    assert cfg.router_aux_loss_coef == ref.config.router_aux_loss_coef
    ours = model_from_state(cfg, hf_to_llmtrain_state(cfg, ref.state_dict())).train()
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(5))
    out = ref(input_ids=ids, output_router_logits=True)
    ours(ids)
    aux = ours.aux_loss()
    # With the shares f_e summing to top-k and P_e to 1, a perfectly balanced router gives top-k.
    assert aux > 0.9 * cfg.num_experts_per_tok
    torch.testing.assert_close(aux, out.aux_loss, atol=1e-5, rtol=1e-5)
    out.aux_loss.backward()
    aux.backward()
    # Parameters the aux loss does not reach (the head, later layers) have no gradient on either side.
    expected = hf_to_llmtrain_state(
        cfg, {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    )
    routers = [n for n, _ in ours.named_parameters() if n.endswith("router.weight")]
    assert len(routers) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) > 0
    for name, p in ours.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        assert name not in routers or grad.abs().sum() > 0, name
        torch.testing.assert_close(
            grad, expected[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )

    ours.eval()
    with torch.no_grad():
        labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
        plain = ref(input_ids=ids, labels=ids).loss  # output_router_logits off: cross-entropy only
        torch.testing.assert_close(ours.loss(ours(ids), labels), plain, atol=1e-5, rtol=1e-5)
