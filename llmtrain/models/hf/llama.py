"""LLaMA (transformers' LlamaForCausalLM) <-> llmtrain's `llama`: config translation and weight rules."""

from __future__ import annotations

from typing import Any

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError
from llmtrain.models.hf.decoder import decoder_fields, decoder_hf_fields, decoder_rules


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig -> ModelConfig fields; attention and MLP biases must agree (one use_bias)."""
    fields = decoder_fields(
        hf, "llama", norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_positions=2048
    )
    bias = hf.get("attention_bias", False)
    if hf.get("mlp_bias", False) != bias:
        raise ModelFormatError(
            f"llama attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} is not supported; "
            "llmtrain's use_bias covers both"
        )
    return fields | {"use_bias": bias}


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """LlamaConfig fields of a llama config."""
    return decoder_hf_fields(cfg) | {
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
    }


ADAPTER = HFAdapter(
    arch="llama",
    model_type="llama",
    hf_class="LlamaForCausalLM",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=decoder_rules,
)
