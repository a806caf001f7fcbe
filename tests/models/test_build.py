"""`llmtrain.models.build`: the module-tree contract, deterministic initialisation, config errors.

References: the initial values as llmtrain.models.init documents them, drawn by hand with torch's
generators (what sharded construction relies on), and the module names of contract A in /work/contracts.md.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch import nn

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.models import (
    ARCHS,
    Attention,
    CausalLM,
    GatedMLP,
    GeluMLP,
    LayerNorm,
    RMSNorm,
    build,
    fill_region,
    init_kinds,
)
from llmtrain.models.mla import LatentAttention
from llmtrain.models.moe import MoEMLP

SMALL = dict(
    num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=101, ffn_hidden_size=40, seq_length=10
)


# DeepSeek's latent attention: full-rank query, value heads wider than query/key heads.
LATENT = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=14)


def _cfg(arch: str, **kw: object) -> ModelConfig:
    if arch == "deepseek_v3":
        return ModelConfig(arch=arch, **SMALL, **LATENT, **kw)
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
        if arch == "deepseek_v3":
            assert isinstance(attn, LatentAttention) and attn.q_a_proj is None and attn.q_b_proj is None
            shapes = {"q_proj": (60, 48), "kv_a_proj": (16, 48), "kv_b_proj": (120, 12), "o_proj": (48, 84)}
            for name, shape in shapes.items():
                assert getattr(attn, name).weight.shape == shape and getattr(attn, name).bias is None
            assert isinstance(attn.kv_a_norm, RMSNorm) and attn.kv_a_norm.weight.shape == (12,)
        else:
            assert isinstance(attn, Attention)
            assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (6, cfg.kv_heads, 8)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert isinstance(getattr(attn, name), nn.Linear)
                assert (getattr(attn, name).bias is not None) == (arch == "gpt")
            assert (attn.q_norm is not None) == (attn.k_norm is not None) == (arch == "qwen3_moe")
        if arch == "gpt":
            assert isinstance(block.mlp, GeluMLP) and block.mlp.up_proj.out_features == 40
        elif cfg.is_moe:
            # Experts stacked: gate_up (experts, 2 * ffn, hidden), down (experts, hidden, ffn); no biases.
            assert isinstance(block.mlp, MoEMLP)
            assert block.mlp.router.weight.shape == (8, 48)
            assert block.mlp.experts.gate_up_proj.shape == (8, 80, 48)
            assert block.mlp.experts.down_proj.shape == (8, 48, 40)
            continue
        else:
            assert isinstance(block.mlp, GatedMLP) and block.mlp.gate_up_proj.out_features == 80
        assert block.mlp.down_proj.in_features == 40
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    assert model(ids).shape == (3, 10, cfg.vocab_size)
    assert model(ids, labels=ids).shape == ()


@pytest.mark.parametrize(
    ("overrides", "moe_layers"),
    [
        (dict(), [0, 1, 2, 3, 4]),
        (dict(moe_layer_interval=2), [1, 3]),
        (dict(moe_layer_start=1, moe_layer_interval=2, dense_layers=[3]), [1]),
        (dict(moe_layer_start=2, moe_ffn_hidden_size=24, num_experts=3), [2, 3, 4]),
    ],
)
def test_moe_layers_follow_start_interval_and_dense_layers(overrides: dict, moe_layers: list[int]) -> None:
    """Layer i is MoE when i >= moe_layer_start, (i + 1) % moe_layer_interval == 0 and i is not in
    dense_layers (transformers' Qwen3-MoE / ERNIE-4.5-MoE rule); dense layers keep ffn_hidden_size."""
    cfg = _cfg("qwen3_moe", num_layers=5, **overrides)
    with torch.device("meta"):
        model = build(cfg)
    assert [i for i, b in enumerate(model.layers) if isinstance(b.mlp, MoEMLP)] == moe_layers
    for i, block in enumerate(model.layers):
        if i in moe_layers:
            ffn = overrides.get("moe_ffn_hidden_size", 40)
            assert block.mlp.experts.down_proj.shape == (overrides.get("num_experts", 8), 48, ffn)
        else:
            assert isinstance(block.mlp, GatedMLP) and block.mlp.down_proj.in_features == 40
    kinds = init_kinds(model)
    moe = model.layers[moe_layers[0]].mlp
    assert {kinds[id(p)] for p in moe.parameters()} == {"normal"}
    assert kinds[id(model.layers[0].attn.q_norm.weight)] == "ones"


def _documented_init(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The normal init as llmtrain.models.init documents it, written out independently: blocks of
    max(1, 2**16 // row size) rows, each drawn whole from a generator seeded with the first 8 bytes
    (little-endian) of blake2b("<seed>/<name>/<block>")."""
    row = math.prod(shape[1:])
    per_block = max(1, 2**16 // row)
    blocks = []
    for b, start in enumerate(range(0, shape[0], per_block)):
        digest = hashlib.blake2b(f"{seed}/{name}/{b}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        blocks.append(
            torch.empty(min(per_block, shape[0] - start), *shape[1:]).normal_(0.0, std, generator=g)
        )
    return torch.cat(blocks)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_init_is_a_function_of_seed_name_and_row_block(arch: str) -> None:
    cfg = _cfg(arch, init_std=0.05)
    state = torch.get_rng_state()
    model = build(cfg, seed=7)
    assert torch.equal(torch.get_rng_state(), state), "build drew from torch's global RNG"
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            expected = torch.ones_like(p)
        elif name.endswith("bias"):
            expected = torch.zeros_like(p)
        else:
            expected = _documented_init(name, tuple(p.shape), 7, 0.05)
        assert torch.equal(p, expected), name
    assert not torch.equal(
        build(cfg, seed=8).layers[0].attn.q_proj.weight, model.layers[0].attn.q_proj.weight
    )
    torch.manual_seed(7)  # without a seed: the one torch.manual_seed set, as a run with train.seed=7
    assert torch.equal(build(cfg).lm_head.weight, model.lm_head.weight)


def test_init_spans_several_blocks_with_the_requested_statistics() -> None:
    """An embedding of 4096 x 768 (48 blocks of 85 rows and one of 16): the documented draw, mean 0
    and std init_std (3.1M samples: standard errors 1.1e-5 of the mean and 8e-6 of the std at std 0.02,
    bounds of 1e-4 are 9 and 12 of them), and no two blocks repeat a stream."""
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=768, num_attention_heads=12, vocab_size=4096)
    w = build(cfg, seed=3).embed_tokens.weight.detach()
    assert torch.equal(w, _documented_init("embed_tokens.weight", (4096, 768), 3, 0.02))
    assert abs(w.mean().item()) < 1e-4 and abs(w.std().item() - 0.02) < 1e-4
    assert not torch.equal(w[:80], w[85:165]) and not torch.equal(w[:80], w[4080:4096].repeat(5, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_region_equals_the_same_region_of_the_whole_tensor(dtype: torch.dtype) -> None:
    """Regions cut across row blocks and columns (as TP and ZeRO-3 shards do), written into contiguous and
    strided outputs: the values of the whole tensor's region (rounded once to `dtype`)."""
    shape = (700, 3000)  # 349 rows per block: blocks end inside most regions
    whole = torch.empty(shape)
    fill_region(whole, "w", "normal", shape, (0, 0), seed=1, std=0.02)
    for rows, cols in [
        ((0, 700), (0, 3000)),
        ((300, 400), (0, 3000)),
        ((348, 351), (17, 1500)),
        ((699, 700), (2999, 3000)),
    ]:
        want = whole[rows[0] : rows[1], cols[0] : cols[1]].to(dtype)
        out = torch.empty(rows[1] - rows[0], cols[1] - cols[0], dtype=dtype)
        fill_region(out, "w", "normal", shape, (rows[0], cols[0]), seed=1, std=0.02)
        assert torch.equal(out, want), (rows, cols)
        strided = torch.empty(cols[1] - cols[0], rows[1] - rows[0], dtype=dtype).t()
        fill_region(strided, "w", "normal", shape, (rows[0], cols[0]), seed=1, std=0.02)
        assert torch.equal(strided, want), (rows, cols)
    with pytest.raises(ValueError, match="leaves the full"):
        fill_region(torch.empty(2, 2), "w", "normal", shape, (699, 0), seed=1, std=0.02)


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


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            dict(num_experts=3, num_experts_per_tok=4),
            "model.num_experts_per_tok=4 exceeds model.num_experts=3",
        ),
        (dict(num_experts=0), "model.num_experts must be at least 1"),
        (dict(use_bias=True), "model.use_bias=false"),
        (dict(dense_layers=[2]), "model.dense_layers names layer 2"),
        (dict(recompute="full"), "model.recompute none or selective"),
    ],
)
def test_bad_moe_configs_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        build(_cfg("mixtral", **overrides))


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
