"""ERNIE-4.5 (transformers' Ernie4_5ForCausalLM and Ernie4_5_MoeForCausalLM) <-> llmtrain's `ernie` and
`ernie_moe`: config translation and weight rules."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError, Rule, Tensors
from llmtrain.models.hf.decoder import decoder_fields, decoder_hf_fields, decoder_rules
from llmtrain.models.hf.moe import MLP_EXPERTS, moe_fields
from llmtrain.models.moe import NORM_MIN

# The router's score bias, shaped (1, experts), in the checkpoint and in transformers' memory.
SCORE_BIAS = "mlp.moe_statics.e_score_correction_bias"
SCORE_BIAS_IN_MEMORY = "mlp.gate.moe_statics.e_score_correction_bias"


def config_fields(hf: dict[str, Any], arch: str = "ernie") -> dict[str, Any]:
    """Ernie4_5Config -> ModelConfig fields (also the dense part of ERNIE-4.5-MoE's, `arch`)."""
    fields = decoder_fields(
        hf,
        arch,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_positions=131072,
        head_dim=128 if arch == "ernie" else None,
    )
    return fields | {"use_bias": hf.get("use_bias", False)}


def moe_config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Ernie4_5_MoeConfig -> ModelConfig fields."""
    fields = config_fields(hf, "ernie_moe")
    fields |= moe_fields(hf, sliding_window=False, num_experts=64, num_experts_per_tok=6)
    if hf.get("moe_norm_min", NORM_MIN) != NORM_MIN:
        raise ModelFormatError(
            f"ernie4_5_moe moe_norm_min={hf['moe_norm_min']} is not supported; llmtrain uses {NORM_MIN}"
        )
    layers = hf.get("num_hidden_layers", 32)
    end = hf.get("moe_layer_end_index", -1)
    end = layers - 1 if end is None or end == -1 else end
    return fields | {
        "num_experts": hf.get("moe_num_experts", hf.get("num_experts", 64)),
        "num_experts_per_tok": hf.get("moe_k", hf.get("num_experts_per_tok", 6)),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 1536),
        "num_shared_experts": hf.get("moe_num_shared_experts") or 0,
        "moe_layer_start": hf.get("moe_layer_start_index", 1),
        "moe_layer_interval": hf.get("moe_layer_interval", 1),
        # ERNIE's end index becomes the dense layers after it.
        "dense_layers": list(range(end + 1, layers)),
    }


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Ernie4_5Config fields of an ernie config."""
    return decoder_hf_fields(cfg) | {"use_bias": cfg.bias}


def moe_hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Ernie4_5_MoeConfig fields of an ernie_moe config (top-k renormalised, dense layers only at the end)."""
    if not cfg.norm_topk_prob:
        raise ModelFormatError(
            "ERNIE-4.5-MoE in transformers always renormalises the top-k router probabilities; set "
            "model.norm_topk_prob=true to convert this ernie_moe model"
        )
    # ERNIE has a last MoE layer (moe_layer_end_index) instead of a list of dense layers.
    end = cfg.num_layers - 1
    while end in cfg.dense_layers:
        end -= 1
    if set(cfg.dense_layers) != set(range(end + 1, cfg.num_layers)):
        raise ModelFormatError(
            f"model.dense_layers={cfg.dense_layers}: ERNIE-4.5-MoE in transformers can only make the last "
            "layers dense (moe_layer_end_index); list a run of layers up to the last one, or none"
        )
    return decoder_hf_fields(cfg) | {
        "use_bias": False,
        "moe_num_experts": cfg.num_experts,
        "moe_k": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_ffn_size,
        "moe_num_shared_experts": cfg.num_shared_experts,
        "moe_layer_start_index": cfg.moe_layer_start,
        "moe_layer_interval": cfg.moe_layer_interval,
        "moe_layer_end_index": end,
        "moe_norm_min": NORM_MIN,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def _row(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].reshape(1, -1)]


def _flat(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].reshape(-1)]


def moe_layer_rules(cfg: ModelConfig, h: str, o: str) -> list[Rule]:
    """The router's score bias (a (1, experts) row in HF, flat in llmtrain), then the experts."""
    score_bias = Rule((f"{h}{SCORE_BIAS}",), (f"{o}mlp.router.score_bias",), _flat, _row)
    return [score_bias, *MLP_EXPERTS.layer_rules(cfg, h, o)]


def moe_checkpoint_names(cfg: ModelConfig, hf_state: Tensors) -> Tensors:
    """Checkpoint names for transformers >= 5's in-memory stacked experts and score bias."""
    hf_state = {k.replace(SCORE_BIAS_IN_MEMORY, SCORE_BIAS): v for k, v in hf_state.items()}
    return MLP_EXPERTS.checkpoint_names(cfg, hf_state)


ADAPTER = HFAdapter(
    arch="ernie",
    model_type="ernie4_5",
    hf_class="Ernie4_5ForCausalLM",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=decoder_rules,
)
MOE_ADAPTER = HFAdapter(
    arch="ernie_moe",
    model_type="ernie4_5_moe",
    hf_class="Ernie4_5_MoeForCausalLM",
    config_fields=moe_config_fields,
    hf_config_fields=moe_hf_config_fields,
    rules=partial(decoder_rules, moe_layer=moe_layer_rules),
    checkpoint_names=moe_checkpoint_names,
)
