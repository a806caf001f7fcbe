"""Mixtral (transformers' MixtralForCausalLM) <-> llmtrain's `mixtral`: config translation and weight rules.

Every layer is a mixture of experts; the checkpoint keeps them under `block_sparse_moe.` with w1/w3/w2 for
the gate/up/down projections."""

from __future__ import annotations

from functools import partial
from typing import Any

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError
from llmtrain.models.hf.decoder import decoder_fields, decoder_hf_fields, decoder_rules
from llmtrain.models.hf.moe import ExpertLayout, moe_fields, moe_hf_fields

EXPERTS = ExpertLayout(
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.{e}.w1.weight",
    "block_sparse_moe.experts.{e}.w3.weight",
    "block_sparse_moe.experts.{e}.w2.weight",
)


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """MixtralConfig -> ModelConfig fields (no sliding window, no router jitter)."""
    fields = decoder_fields(
        hf, "mixtral", norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, max_positions=4096 * 32
    )
    fields |= {"use_bias": False}
    fields |= moe_fields(hf, sliding_window=True, num_experts=8, num_experts_per_tok=2)
    if hf.get("router_jitter_noise", 0.0):
        raise ModelFormatError(
            f"mixtral router_jitter_noise={hf['router_jitter_noise']} is not supported; set it to 0"
        )
    return fields


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """MixtralConfig fields of a mixtral config (experts in every layer, top-k renormalised)."""
    if not cfg.norm_topk_prob:
        raise ModelFormatError(
            "Mixtral in transformers always renormalises the top-k router probabilities; set "
            "model.norm_topk_prob=true to convert this mixtral model"
        )
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise ModelFormatError(
            "Mixtral in transformers has experts in every layer; set model.moe_layer_start=0, "
            "model.moe_layer_interval=1 and model.dense_layers=[] to convert this mixtral model"
        )
    return (
        decoder_hf_fields(cfg)
        | moe_hf_fields(cfg)
        | {
            "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.expert_ffn_size,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    )


ADAPTER = HFAdapter(
    arch="mixtral",
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=partial(decoder_rules, moe_layer=EXPERTS.layer_rules),
    checkpoint_names=EXPERTS.checkpoint_names,
)
