"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM) <-> llmtrain's `qwen3_moe`: config translation and weight
rules. Its attention normalises each query and key head (q_norm, k_norm)."""

from __future__ import annotations

from functools import partial
from typing import Any

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError, Rule, rename
from llmtrain.models.hf.decoder import attention_rules, decoder_fields, decoder_hf_fields, decoder_rules
from llmtrain.models.hf.moe import MLP_EXPERTS, moe_fields, moe_hf_fields


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3MoeConfig -> ModelConfig fields (no biases, no sliding window)."""
    fields = decoder_fields(
        hf, "qwen3_moe", norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_positions=32768
    )
    if hf.get("attention_bias", False):
        raise ModelFormatError(
            "qwen3_moe attention_bias=True is not supported; llmtrain's qwen3_moe has no biases"
        )
    fields |= {"use_bias": False}
    fields |= moe_fields(hf, sliding_window=False, num_experts=128, num_experts_per_tok=8)
    return fields | {
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 768),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layer_interval": hf.get("decoder_sparse_step", 1),
        "dense_layers": sorted(hf.get("mlp_only_layers") or []),
    }


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3MoeConfig fields of a qwen3_moe config."""
    # Qwen3-MoE has no start index: the layers before moe_layer_start are listed as dense.
    dense = sorted(set(cfg.dense_layers) | set(range(min(cfg.moe_layer_start, cfg.num_layers))))
    return (
        decoder_hf_fields(cfg)
        | moe_hf_fields(cfg)
        | {
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.expert_ffn_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.moe_layer_interval,
            "mlp_only_layers": dense,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    )


def qk_norm_attention_rules(cfg: ModelConfig, hf: str, ours: str) -> list[Rule]:
    """The q, k, v, o projections, then the per-head query and key RMSNorms."""
    norms = [rename(f"{hf}{p}_norm.weight", f"{ours}{p}_norm.weight") for p in "qk"]
    return attention_rules(cfg, hf, ours) + norms


ADAPTER = HFAdapter(
    arch="qwen3_moe",
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=partial(decoder_rules, attention=qk_norm_attention_rules, moe_layer=MLP_EXPERTS.layer_rules),
    checkpoint_names=MLP_EXPERTS.checkpoint_names,
)
