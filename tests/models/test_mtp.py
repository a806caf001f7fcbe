"""Multi-token prediction (llmtrain.models.mtp) against a float64 reference written from the DeepSeek-V3
report's equations (arXiv:2412.19437, eqs. 21-25), and its config rules.

The reference below re-derives everything multi-token prediction adds: the RMSNorms, the projection of the
concatenation in the report's order [RMSNorm(h); RMSNorm(Emb(t_{i+k}))] (the model stores M_k with the
embedding half first, as the published weights do: the reference reorders M_k's column blocks), the
shared output head and softmax cross-entropy, the index ranges of each depth and lambda / D. It calls the
main model's trunk (embedding and layers) and each module's transformer block as black boxes: those are
held to transformers elsewhere (tests/models/test_equivalence.py). Both sides run in float64, the model's
cross-entropy included (it casts logits with `.float()`, which tests/parallel/_reference.py's `_float64_math`
keeps float64): a few hundred float64 roundings (unit 1.1e-16) apart, bound 1e-12 relative (of the loss,
and of each gradient tensor's largest entry). Any error in the equations (an order, a shift, a norm,
lambda / D) is orders of magnitude above it.
"""

from __future__ import annotations

import pytest
import torch

from llmtrain.config import ConfigError, JobConfig, ModelConfig, validate
from llmtrain.models import build
from llmtrain.models.mtp import mtp_loss_weight, set_mtp_loss_weight
from tests.parallel._reference import _float64_math

DENSE = dict(
    arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=48,
    vocab_size=61, seq_length=12, kernels="torch",
)  # fmt: skip
MOE = dict(
    arch="deepseek_v3", num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
    vocab_size=61, seq_length=12, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=16, num_shared_experts=1, moe_layer_start=1,
    router_aux_loss_coef=0.0, kernels="torch",
)  # fmt: skip


RTOL = 1e-12
GRAD_RTOL = 1e-12


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """L_Main + lambda / D * sum_k L_MTP^k for (b, T + 1) tokens t_1..t_{T+1} (0-based here: t[0..T])."""
    cfg = model.config
    eps, D, lam = cfg.norm_eps, cfg.mtp_layers, model.mtp.weight
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    inputs = tokens[:, :-1]
    T = inputs.shape[1]
    x = model.embed(inputs)
    rope = model.rope(T, x.device, x.dtype)
    for layer in model.layers:
        x = layer(x, rope)
    h = _rms(x, model.final_norm.weight, eps)  # h^0_i, i = 1..T

    def ce(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over positions of -log softmax(OutHead(hidden))[target]."""
        logp = torch.log_softmax(hidden @ head.t(), dim=-1)
        return -logp.gather(-1, targets[..., None]).mean()

    main = ce(h, tokens[:, 1:])
    mtp = []
    for k in range(1, D + 1):
        m = model.mtp.layers[k - 1]
        n = cfg.hidden_size
        M = torch.cat([m.eh_proj.weight[:, n:], m.eh_proj.weight[:, :n]], dim=1)  # the report's [h; emb]
        # Eq. 21 for i = 1..T-k: h'^k_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))].
        e = emb[tokens[:, k:T]]  # t_{i+k}, i = 1..T-k (0-based: tokens[i-1+k])
        combined = torch.cat([_rms(h[:, : T - k], m.hnorm.weight, eps), _rms(e, m.enorm.weight, eps)], -1)
        # Eq. 22: h^k_{1:T-k} = TRM_k(h'^k_{1:T-k}); the model's own final norm of the block output
        # (shared_head.norm) before OutHead (eq. 23).
        block_out = m.block(combined @ M.t(), model.rope(T - k, x.device, x.dtype))
        h = _rms(block_out, m.final_norm.weight, eps)
        # Eq. 24: targets t_{i+k+1}, i = 1..T-k; averaged over those T-k positions (the report divides the
        # sum by T; llmtrain, as Megatron-Core, by the positions that have a target).
        mtp.append(ce(h, tokens[:, k + 1 :]))
    return main + lam / D * torch.stack(mtp).sum()


@pytest.mark.slow  # several seconds on 2 shared cores: a float64 forward and two backwards per arch
@pytest.mark.parametrize("extra", [DENSE, MOE], ids=["llama", "deepseek_v3"])
def test_loss_and_gradients_equal_the_float64_reference(extra: dict) -> None:
    cfg = ModelConfig(**extra, mtp_layers=2, mtp_loss_weight=0.3)
    model = build(cfg, seed=3).double().train()
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    with _float64_math():
        ours = model(tokens[:, :-1], labels=tokens[:, 1:])
        ref = _reference_loss(model, tokens)
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=0)
        g_ours = torch.autograd.grad(ours, params, allow_unused=True)
        g_ref = torch.autograd.grad(ref, params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, g_ours, g_ref, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            assert err < GRAD_RTOL, (name, err)
    assert any(
        n.startswith("mtp.layers.1.") and g is not None and g.abs().sum() > 0
        for n, g in zip(names, g_ours, strict=True)
    )
    per_depth = model.mtp.last_losses
    assert per_depth.shape == (2,) and bool((per_depth > 0).all())


def test_evaluation_and_logits_leave_the_modules_out() -> None:
    cfg = ModelConfig(**DENSE, mtp_layers=1)
    model = build(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1))
    plain = ModelConfig(**DENSE)
    base = build(plain, seed=0)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    model.eval(), base.eval()
    torch.testing.assert_close(
        model(tokens[:, :-1], labels=tokens[:, 1:]), base(tokens[:, :-1], labels=tokens[:, 1:])
    )
    assert model(tokens[:, :-1]).shape == (1, cfg.seq_length, cfg.vocab_size)


def test_the_published_weight_schedule() -> None:
    cfg = ModelConfig(**DENSE, mtp_layers=1, mtp_loss_weight_later=0.1, mtp_loss_weight_tokens=10**13)
    assert mtp_loss_weight(cfg, 0) == 0.3 and mtp_loss_weight(cfg, 10**13 - 1) == 0.3
    assert mtp_loss_weight(cfg, 10**13) == 0.1
    assert mtp_loss_weight(ModelConfig(**DENSE, mtp_layers=1), 10**15) == 0.3
    model = build(cfg, seed=0)
    set_mtp_loss_weight(model, 0.1)
    assert model.mtp.weight == 0.1


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        (
            dict(arch="gpt", mtp_layers=1),
            {},
            "model.mtp_layers needs an architecture without learned positions",
        ),
        (dict(mtp_layers=-1), {}, "model.mtp_layers must be >= 0"),
        (dict(mtp_layers=1, mtp_loss_weight=-0.1), {}, "model.mtp_loss_weight must be >= 0"),
        (dict(mtp_layers=16, seq_length=16), {}, "lower mtp_layers below seq_length"),
    ],
)
def test_bad_configs_name_the_field(model: dict, parallel: dict, message: str) -> None:
    job = JobConfig(model=ModelConfig(**model))
    for key, value in parallel.items():
        setattr(job.parallel, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(job)


def test_pipeline_parallelism_takes_the_modules() -> None:
    # The last stage holds them with its copy of the embedding (tests/parallel/test_mtp_layouts.py).
    job = JobConfig(model=ModelConfig(**DENSE, mtp_layers=2))
    job.parallel.pp = 2
    validate(job)
