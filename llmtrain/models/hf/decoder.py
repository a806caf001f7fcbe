"""The LLaMA-style layout most families share (`model.layers.N.self_attn...`, RMSNorms, a gated MLP, the
default rotary): its config.json fields both ways and its weight rules, with the attention and MoE layers
left to the family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import ModelFormatError, Rule, gated_mlp_rules, rename

LayerRules = Callable[[ModelConfig, str, str], list[Rule]]
"""The rules of one part of a decoder layer, given the config and the HF and llmtrain name prefixes."""


def decoder_fields(
    hf: dict[str, Any],
    arch: str,
    *,
    norm_eps: float,
    rope_theta: float,
    tie_word_embeddings: bool,
    max_positions: int,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """ModelConfig fields (all but use_bias) of a LLaMA-style config.json; the keywords are the defaults of
    the family's transformers config class, for the keys a config.json leaves out."""
    model_type = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFormatError(
            f"{model_type} hidden_act={act!r} is not supported; llmtrain's {arch} uses silu (SwiGLU)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelFormatError(
            f"{model_type} rope {rope!r} is not supported; llmtrain implements the default full-width "
            "rotary only"
        )
    heads = hf.get("num_attention_heads", 32)
    return {
        "num_layers": hf.get("num_hidden_layers", 32),
        "hidden_size": hf.get("hidden_size", 4096),
        "num_attention_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim", head_dim),
        "ffn_hidden_size": hf.get("intermediate_size", 11008),
        "vocab_size": hf.get("vocab_size", 32000),
        "max_position_embeddings": hf.get("max_position_embeddings", max_positions),
        "norm_eps": hf.get("rms_norm_eps", norm_eps),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", rope_theta))),
        "attention_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
        "init_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": hf.get("tie_word_embeddings", tie_word_embeddings),
    }


def decoder_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a LLaMA-style model that every such family writes the same way."""
    return {
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "intermediate_size": cfg.ffn_size,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # where transformers < 5 reads it
    }


def attention_rules(cfg: ModelConfig, hf: str, ours: str) -> list[Rule]:
    """Grouped-query attention: q, k, v and o projections renamed (with their biases under use_bias)."""
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    return [rename(f"{hf}{p}_proj.{k}", f"{ours}{p}_proj.{k}") for p in "qkvo" for k in kinds]


def decoder_rules(
    cfg: ModelConfig, attention: LayerRules = attention_rules, moe_layer: LayerRules | None = None
) -> list[Rule]:
    """Embedding, every decoder layer and the final norm: `attention` maps a layer's self_attn, `moe_layer`
    the MLP of each layer `cfg.is_moe_layer` names (given the layer prefixes), a gated MLP the others."""
    rules = [rename("model.embed_tokens.weight", "embed_tokens.weight")]
    for i in range(cfg.num_layers):
        rules += layer_rules(cfg, i, f"model.layers.{i}.", f"layers.{i}.", attention, moe_layer)
    rules.append(rename("model.norm.weight", "final_norm.weight"))
    return rules


def layer_rules(
    cfg: ModelConfig,
    index: int,
    h: str,
    o: str,
    attention: LayerRules = attention_rules,
    moe_layer: LayerRules | None = None,
) -> list[Rule]:
    """One decoder layer (block `index`) under the prefixes `h` (Hugging Face) and `o` (llmtrain)."""
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    rules = [rename(f"{h}input_layernorm.weight", f"{o}input_norm.weight")]
    rules += attention(cfg, f"{h}self_attn.", f"{o}attn.")
    rules.append(rename(f"{h}post_attention_layernorm.weight", f"{o}post_attn_norm.weight"))
    if moe_layer is not None and cfg.is_moe_layer(index):
        return rules + moe_layer(cfg, h, o)
    return rules + gated_mlp_rules(f"{h}mlp.", f"{o}mlp.", kinds)
