"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) <-> llmtrain's `deepseek_v3`: config translation and
weight rules. Multi-head latent attention (llmtrain.models.mla), a sigmoid router with a score bias, dense
layers before `first_k_dense_replace`, YaRN rope; the multi-token prediction layers as
llmtrain.models.hf.deepseek_mtp maps them (transformers' DeepseekV3ForCausalLM itself does not run them)."""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError, Rule, Tensors, rename
from llmtrain.models.hf.decoder import decoder_rules
from llmtrain.models.hf.deepseek_mtp import mtp_layers_present, with_mtp
from llmtrain.models.hf.moe import MLP_EXPERTS
from llmtrain.models.rope import YARN_BETA_FAST, YARN_BETA_SLOW

# The router's score bias, shaped (experts,), under one name in the checkpoint and in transformers' memory.
SCORE_BIAS = "mlp.gate.e_score_correction_bias"


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepseekV3Config (defaults: DeepSeek-V3's sizes) -> ModelConfig fields."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(
            f"deepseek_v3 hidden_act={hf['hidden_act']!r} is not supported; llmtrain uses silu (SwiGLU)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    for key, want in (("rope_interleave", True), ("attention_bias", False)):
        if hf.get(key, want) != want:
            raise ModelFormatError(
                f"deepseek_v3 {key}={hf[key]!r} is not supported; llmtrain needs {key}={want}"
            )
    heads = hf.get("num_attention_heads", 128)
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ModelFormatError(
            f"deepseek_v3 num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads="
            f"{heads}; latent attention expands keys and values to every head, so they must be equal"
        )
    return _rope_fields(rope) | {
        "num_layers": hf.get("num_hidden_layers", 61),
        "hidden_size": hf.get("hidden_size", 7168),
        "num_attention_heads": heads,
        "ffn_hidden_size": hf.get("intermediate_size", 18432),
        "vocab_size": hf.get("vocab_size", 129280),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "attention_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
        "init_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "use_bias": False,
        "num_experts": hf.get("n_routed_experts", hf.get("num_local_experts", 256)),
        "num_experts_per_tok": hf.get("num_experts_per_tok") or 8,
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 2048),
        "num_shared_experts": hf.get("n_shared_experts") or 0,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 2.5)),
        "num_expert_groups": hf.get("n_group") or 1,
        "topk_expert_groups": hf.get("topk_group") or 1,
        "moe_layer_start": hf.get("first_k_dense_replace") or 0,
        # transformers computes no auxiliary loss for DeepSeek-V3, which balances by its score bias.
        "router_aux_loss_coef": 0.0,
        "q_lora_rank": hf.get("q_lora_rank", 1536),
        "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
        "v_head_dim": hf.get("v_head_dim", 128),
        "mtp_layers": hf.get("num_nextn_predict_layers") or 0,
    }


def _rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's rope parameters: the default rotary, or YaRN with its published betas."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return {}
    fixed = {
        "beta_fast": YARN_BETA_FAST,
        "beta_slow": YARN_BETA_SLOW,
        "truncate": True,
        "attention_factor": None,
    }
    off = {k: rope[k] for k, want in fixed.items() if rope.get(k) not in (None, want)}
    if rope_type != "yarn" or off or rope.get("factor") is None:
        raise ModelFormatError(
            f"deepseek_v3 rope {rope!r} is not supported; llmtrain implements the default rotary and YaRN "
            f"with a factor and beta_fast={YARN_BETA_FAST:g}, beta_slow={YARN_BETA_SLOW:g}, truncate=true, "
            "no attention_factor"
        )
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(rope["factor"]),
        "rope_original_max_positions": rope["original_max_position_embeddings"],
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """DeepseekV3Config fields of a deepseek_v3 config (experts in every layer from moe_layer_start on)."""
    if not all(cfg.is_moe_layer(i) for i in range(cfg.moe_layer_start, cfg.num_layers)):
        raise ModelFormatError(
            "DeepSeek-V3 in transformers has experts in every layer from first_k_dense_replace on; set "
            "model.moe_layer_interval=1 and model.dense_layers=[] (dense layers only before moe_layer_start)"
        )
    return {
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_size,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(cfg),
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_ffn_size,
        "n_shared_experts": cfg.num_shared_experts,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.num_expert_groups,
        "topk_group": cfg.topk_expert_groups,
        "first_k_dense_replace": min(cfg.moe_layer_start, cfg.num_layers),
        "num_nextn_predict_layers": cfg.mtp_layers,
        "output_router_logits": False,
    }


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's rope_parameters: the default rotary, or YaRN with its published betas."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_scaling_factor,
        "original_max_position_embeddings": cfg.rope_original_max_positions,
        "beta_fast": YARN_BETA_FAST,
        "beta_slow": YARN_BETA_SLOW,
        "mscale": cfg.rope_mscale,
        "mscale_all_dim": cfg.rope_mscale_all_dim,
    }


def latent_attention_rules(cfg: ModelConfig, hf: str, ours: str) -> list[Rule]:
    """DeepSeek's multi-head latent attention (llmtrain.models.mla): renames only."""
    names = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_norm", "q_b_proj"]
    names += ["kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"]
    hf_names = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm"}
    return [rename(f"{hf}{hf_names.get(n, n)}.weight", f"{ours}{n}.weight") for n in names]


def _empty_shared_experts(cfg: ModelConfig, hf: str) -> Rule:
    """transformers' DeepSeek-V3 always has a shared-experts MLP, of width 0 without shared experts: its empty
    tensors have no llmtrain counterpart."""
    h = cfg.hidden_size
    shapes = {"gate_proj": (0, h), "up_proj": (0, h), "down_proj": (h, 0)}
    return Rule(
        tuple(f"{hf}{p}.weight" for p in shapes),
        (),
        lambda ts: [],
        lambda ts: [torch.empty(shape) for shape in shapes.values()],
    )


def moe_layer_rules(cfg: ModelConfig, h: str, o: str) -> list[Rule]:
    """The router's score bias, the (possibly empty) shared experts, then the routed experts."""
    rules = [rename(f"{h}{SCORE_BIAS}", f"{o}mlp.router.score_bias")]
    if not cfg.num_shared_experts:
        rules.append(_empty_shared_experts(cfg, f"{h}mlp.shared_experts."))
    return rules + MLP_EXPERTS.layer_rules(cfg, h, o)


def checkpoint_names(cfg: ModelConfig, hf_state: Tensors) -> Tensors:
    """Without the layers past the config's multi-token prediction modules (a checkpoint may hold more than
    the config asks for), and with transformers >= 5's in-memory stacked experts under their checkpoint
    names."""
    kept = {k: v for k, v in hf_state.items() if _layer_index(k) < cfg.num_layers + cfg.mtp_layers}
    return MLP_EXPERTS.checkpoint_names(cfg, kept)


def state_config(cfg: ModelConfig, hf_state: Tensors) -> ModelConfig:
    """config.json's config with as many MTP layers as the checkpoint holds."""
    return dataclasses.replace(cfg, mtp_layers=mtp_layers_present(cfg, hf_state))


def _layer_index(key: str) -> int:
    """The decoder layer a Hugging Face tensor name belongs to (-1 for none)."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else -1


ADAPTER = HFAdapter(
    arch="deepseek_v3",
    model_type="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=with_mtp(
        partial(decoder_rules, attention=latent_attention_rules, moe_layer=moe_layer_rules),
        latent_attention_rules,
        moe_layer_rules,
    ),
    checkpoint_names=checkpoint_names,
    state_config=state_config,
)
