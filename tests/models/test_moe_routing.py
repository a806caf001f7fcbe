"""Routing options of the MoE layers: expert capacity with token dropping, the router z-loss, the score-bias
update, and the config errors that guard them.

References: each layer recomputed by hand, token by token, from its router's and experts' weights (a dense
per-token loop, no sorting), and the ST-MoE z-loss written out from the router logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import ConfigError, JobConfig, ModelConfig, validate
from llmtrain.models import build
from llmtrain.models.moe import MoEMLP, Router, update_score_bias

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=12)
DEEPSEEK = dict(
    arch="deepseek_v3",
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    num_experts=6,
    num_experts_per_tok=3,
    moe_ffn_hidden_size=16,
    num_shared_experts=1,
    num_expert_groups=3,
    topk_expert_groups=2,
    routed_scaling_factor=2.5,
)


def _by_hand(mlp: MoEMLP, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output token by token: sum of weight * expert(token) over the kept top-k, plus shared."""
    r = mlp.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(r.experts.shape[1]):
            if keep is not None and not keep[t, slot]:
                continue
            e = int(r.experts[t, slot])
            gate, up = F.linear(x[t], mlp.experts.gate_up_proj[e]).chunk(2)
            out[t] += r.weights[t, slot] * F.linear(F.silu(gate) * up, mlp.experts.down_proj[e])
    if mlp.shared_experts is not None:
        out += mlp.shared_experts(x)
    return out


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_capacity_drops_the_lowest_weights_beyond_each_experts_capacity(arch: str) -> None:
    extra = DEEPSEEK if arch == "deepseek_v3" else dict(arch=arch, num_experts=5, num_experts_per_tok=2)
    cfg = ModelConfig(**SMALL, **extra, moe_capacity_factor=1.0)
    torch.manual_seed(0)
    mlp = build(cfg).layers[0].mlp
    with torch.no_grad():  # a skewed router, so that some experts overflow
        mlp.router.weight.add_(torch.linspace(0, 0.5, cfg.num_experts)[:, None])
    x = torch.randn(40, cfg.hidden_size)
    out = mlp(x)
    r = mlp.router(x)
    weights = r.weights.detach()
    k, n = cfg.num_experts_per_tok, cfg.num_experts
    capacity = math.ceil(1.0 * 40 * k / n)
    keep = torch.ones(40, k, dtype=torch.bool)
    for e in range(n):
        slots = (r.experts == e).nonzero().tolist()
        slots.sort(key=lambda ts: (-float(weights[ts[0], ts[1]]), ts[0]))
        for t, s in slots[capacity:]:
            keep[t, s] = False
    dropped = int((~keep).sum())
    assert dropped > 0, "the skewed router should overflow an expert"
    assert float(mlp.stats.dropped) == dropped
    assert mlp.stats.tokens_per_expert.sum() == 40 * k  # the load counts the routing, drops included
    torch.testing.assert_close(out, _by_hand(mlp, x, keep), atol=1e-5, rtol=1e-5)

    mlp.capacity_factor = float(n)  # room for every assignment: the dropless layer, bit for bit
    roomy = mlp(x)
    mlp.capacity_factor = None
    assert torch.equal(roomy, mlp(x)) and float(mlp.stats.dropped) == 0
    torch.testing.assert_close(roomy, _by_hand(mlp, x), atol=1e-5, rtol=1e-5)


def test_z_loss_and_aux_loss_enter_the_training_loss() -> None:
    cfg = ModelConfig(**SMALL, **DEEPSEEK, router_z_loss_coef=0.01, router_aux_loss_coef=0.02)
    torch.manual_seed(1)
    model = build(cfg).train()
    logits: list[torch.Tensor] = []

    def grab(module: Router, args: tuple[torch.Tensor], out: object) -> None:
        logits.append(F.linear(args[0].double(), module.weight.double()))

    for router in model.routers():
        router.register_forward_hook(grab)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    loss = model(ids, labels=ids)
    assert len(logits) == cfg.num_layers  # every layer is MoE (moe_layer_start=0)
    z = torch.cat([torch.logsumexp(lg, dim=-1) ** 2 for lg in logits]).mean()
    ce = F.cross_entropy(model(ids).flatten(0, 1).double(), ids.flatten())
    expected = ce + 0.02 * model.aux_loss().double() + 0.01 * z
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)
    model.eval()
    torch.testing.assert_close(model(ids, labels=ids).double(), ce, atol=1e-5, rtol=1e-5)


def test_score_bias_update_moves_toward_balance() -> None:
    cfg = ModelConfig(**SMALL, **DEEPSEEK)
    routers = build(cfg).routers()
    load = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.0, 6.0]] * len(routers))  # mean 3
    update_score_bias(routers, load, 0.25)
    update_score_bias(routers, load, 0.25)
    for router in routers:
        assert router.score_bias.tolist() == [-0.5, 0.5, 0.0, 0.0, 0.5, -0.5]
        assert not router.score_bias.requires_grad


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(moe_capacity_factor=0.5), "moe_capacity_factor=0.5 gives the experts fewer slots"),
        (dict(num_expert_groups=4), "num_expert_groups=4 does not divide model.num_experts=6"),
        (dict(num_expert_groups=6, topk_expert_groups=3), "leaves 1 expert per group"),
        (dict(topk_expert_groups=4), "topk_expert_groups=4 exceeds model.num_expert_groups=3"),
        (dict(topk_expert_groups=1, num_experts_per_tok=3), "num_experts_per_tok=3 exceeds the 2 experts"),
        (dict(num_kv_heads=2), "num_kv_heads=2: deepseek_v3's latent attention"),
        (dict(arch="mixtral", num_shared_experts=0), "num_expert_groups=3: model.arch=mixtral has no"),
        (
            dict(arch="qwen3_moe", num_shared_experts=0, num_expert_groups=1, topk_expert_groups=1),
            "routed_scaling_factor=2.5: model.arch=qwen3_moe",
        ),
        (
            dict(arch="mixtral", **{k: 1 for k in ("num_expert_groups", "topk_expert_groups")}),
            "num_shared_experts=1: model.arch=mixtral",
        ),
        (dict(q_lora_rank=0), "model.q_lora_rank must be at least 1"),
        (dict(rope_scaling="yarn", rope_scaling_factor=0.0), "model.rope_scaling_factor must be positive"),
        (
            dict(arch="qwen3_moe", rope_scaling="yarn", num_expert_groups=1, topk_expert_groups=1),
            "model.rope_scaling=yarn is implemented for deepseek_v3 only",
        ),
    ],
)
def test_bad_routing_configs_name_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(JobConfig(model=ModelConfig(**SMALL, **{**DEEPSEEK, **overrides})))


def test_bias_update_rate_defaults_and_refusals() -> None:
    assert ModelConfig(**SMALL, **DEEPSEEK).bias_update_rate == 1e-3
    assert ModelConfig(arch="ernie_moe").bias_update_rate == 0.0
    assert ModelConfig(arch="ernie_moe", router_bias_update_rate=1e-3).bias_update_rate == 1e-3
    with pytest.raises(
        ConfigError, match="router_bias_update_rate=0.001: model.arch=mixtral routers have no"
    ):
        validate(JobConfig(model=ModelConfig(arch="mixtral", router_bias_update_rate=1e-3)))
