"""`llmtrain.models.build`: the module-tree contract, deterministic initialisation, config errors.

References: torch's RNG drawn by hand in named_parameters() order (what TP sharding relies on) and
the module names of contract A in /work/contracts.md.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.models import ARCHS, Attention, CausalLM, GatedMLP, GeluMLP, LayerNorm, RMSNorm, build

SMALL = dict(
    num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=101, ffn_hidden_size=40, seq_length=10
)


def _cfg(arch: str, **kw: object) -> ModelConfig:
    return ModelConfig(**{"arch": arch, "num_kv_heads": None if arch == "gpt" else 2, **SMALL, **kw})


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_module_tree_follows_the_contract(arch: str) -> None:
    cfg = _cfg(arch)
    torch.manual_seed(0)
    model = build(cfg)
    assert isinstance(model, CausalLM)
    assert isinstance(model.embed_tokens, nn.Embedding) and isinstance(model.embed_dropout, nn.Dropout)
    assert (model.embed_positions is not None) == (arch == "gpt")
    assert len(model.layers) == cfg.num_layers and model.loss_tp_group is None
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tied_embeddings
    assert model.lm_head.bias is None
    norm = LayerNorm if arch == "gpt" else RMSNorm
    for block in model.layers:
        assert isinstance(block.input_norm, norm) and isinstance(block.post_attn_norm, norm)
        attn = block.attn
        assert isinstance(attn, Attention)
        assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (6, cfg.kv_heads, 8)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(attn, name), nn.Linear)
            assert (getattr(attn, name).bias is not None) == (arch == "gpt")
        if arch == "gpt":
            assert isinstance(block.mlp, GeluMLP) and block.mlp.up_proj.out_features == 40
        else:
            assert isinstance(block.mlp, GatedMLP) and block.mlp.gate_up_proj.out_features == 80
        assert block.mlp.down_proj.in_features == 40
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    assert model(ids).shape == (3, 10, cfg.vocab_size)
    assert model(ids, labels=ids).shape == ()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_init_is_one_draw_per_parameter_in_order(arch: str) -> None:
    cfg = _cfg(arch, init_std=0.05)
    torch.manual_seed(7)
    model = build(cfg)
    # Reference: the same seed drawn by hand, one full tensor per parameter in named_parameters() order.
    torch.manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            expected = torch.ones_like(p)
        elif name.endswith("bias"):
            expected = torch.zeros_like(p)
        else:
            expected = torch.empty_like(p).normal_(0.0, 0.05)
        assert torch.equal(p, expected), name
    torch.manual_seed(8)
    assert not torch.equal(build(cfg).layers[0].attn.q_proj.weight, model.layers[0].attn.q_proj.weight)


def test_meta_build_allocates_nothing() -> None:
    with torch.device("meta"):
        model = build(
            ModelConfig(
                arch="llama",
                num_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                num_kv_heads=8,
                vocab_size=128256,
                ffn_hidden_size=14336,
                seq_length=8192,
            )
        )
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3-8B


def test_rope_returns_none_for_gpt_and_position_ids_match_lengths() -> None:
    torch.manual_seed(0)
    assert build(_cfg("gpt")).rope(10) is None
    model = build(_cfg("ernie"))
    cos, sin = model.rope(10)
    pos_cos, pos_sin = model.rope(torch.arange(10))
    assert cos.shape == (10, 8) and torch.equal(cos, pos_cos) and torch.equal(sin, pos_sin)
    assert torch.equal(cos[:, 0::2], cos[:, 1::2])  # interleaved pairs share their angle


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_attention_heads=6, num_kv_heads=4), "model.num_kv_heads"),
        (dict(hidden_size=50), "model.hidden_size"),
        (dict(max_position_embeddings=5), "model.max_position_embeddings"),
    ],
)
def test_bad_configs_name_the_field(overrides: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        build(_cfg("llama", **overrides))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_dropout_acts_in_training_only(arch: str) -> None:
    """Reference: the same weights without dropout (eval mode must equal it; training must not)."""
    torch.manual_seed(0)
    plain = build(_cfg(arch))
    noisy = build(_cfg(arch, hidden_dropout=0.3, attention_dropout=0.3))
    noisy.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 101, (2, 10))
    assert torch.equal(noisy.eval()(ids), plain(ids))
    assert not torch.allclose(noisy.train()(ids), plain(ids))
