"""Hugging Face interop: config translation, per-architecture weight-name mapping, load and save.

Two directory formats:
- llmtrain: `llmtrain_config.yaml` (`model:` section, readable by llmtrain.config.load) + `model.safetensors`
  with llmtrain parameter names (a tied lm_head is not stored).
- Hugging Face: `config.json` + `model.safetensors` (or a sharded `model.safetensors.index.json`), as
  `transformers`' GPT2LMHeadModel / LlamaForCausalLM / Ernie4_5ForCausalLM / MixtralForCausalLM /
  Qwen3MoeForCausalLM / Ernie4_5_MoeForCausalLM / DeepseekV3ForCausalLM write and read them (experts one
  tensor per expert and projection, the checkpoint layout; `hf_to_llmtrain_state` also takes the stacked
  in-memory layout of transformers >= 5).
The conversion is pure renaming, transposing, splitting and concatenating, so round trips are bitwise.
transformers itself is not needed here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.config.loader import dump_yaml, from_dict, load_yaml
from llmtrain.config.schema import MOE_ARCHS
from llmtrain.errors import UserError
from llmtrain.models.causal_lm import CausalLM, check_config, empty_model
from llmtrain.models.moe import NORM_MIN
from llmtrain.models.registry import get_arch
from llmtrain.models.rope import YARN_BETA_FAST, YARN_BETA_SLOW

LLMTRAIN_CONFIG = "llmtrain_config.yaml"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

MODEL_TYPE_TO_ARCH = {
    "gpt2": "gpt",
    "llama": "llama",
    "ernie4_5": "ernie",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "ernie4_5_moe": "ernie_moe",
    "deepseek_v3": "deepseek_v3",
}
ARCH_TO_MODEL_TYPE = {v: k for k, v in MODEL_TYPE_TO_ARCH.items()}
HF_CLASSES = {
    "gpt": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "ernie": "Ernie4_5ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "ernie_moe": "Ernie4_5_MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# GPT-2's "gelu_new" and these aliases are all the tanh approximation our GPT MLP computes.
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh")
# Buffers some checkpoints carry (GPT-2 causal masks, old LLaMA inv_freq): recomputed, not loaded.
IGNORED_HF_KEYS = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")

Tensors = dict[str, torch.Tensor]


class ModelFormatError(UserError, ValueError):
    """A model directory or config cannot be read, written or converted; the message names the file or
    field and the fix."""


# ---------------------------------------------------------------- configs


def from_hf_config(hf_config: Mapping[str, Any] | Any) -> ModelConfig:
    """ModelConfig of a transformers config (object or config.json dict) of a model type in
    MODEL_TYPE_TO_ARCH."""
    hf = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCH:
        raise ModelFormatError(
            f"model_type={model_type!r} is not supported; supported Hugging Face model types: "
            f"{', '.join(MODEL_TYPE_TO_ARCH)}"
        )
    arch = MODEL_TYPE_TO_ARCH[model_type]
    if arch == "gpt":
        fields = _gpt2_fields(hf)
    elif arch == "deepseek_v3":
        fields = _deepseek_fields(hf)
    else:
        fields = _llama_like_fields(hf, arch)
        if arch in MOE_ARCHS:
            fields |= _moe_fields(hf, arch)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    if fields.get("num_kv_heads") == heads:
        fields["num_kv_heads"] = None
    if fields.get("head_dim") is not None and hidden % heads == 0 and fields["head_dim"] == hidden // heads:
        fields["head_dim"] = None
    fields["seq_length"] = min(ModelConfig.seq_length, fields["max_position_embeddings"])
    cfg = ModelConfig(arch=arch, **fields)
    check_config(cfg)
    return cfg


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise ModelFormatError(
            f"gpt2 activation_function={act!r} is not supported; llmtrain's GPT uses gelu_new (tanh)"
        )
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(key, want) != want:
            raise ModelFormatError(
                f"gpt2 {key}={hf[key]!r} is not supported; llmtrain's GPT needs {key}={want}"
            )
    return {
        "num_layers": hf.get("n_layer", 12),
        "hidden_size": hf.get("n_embd", 768),
        "num_attention_heads": hf.get("n_head", 12),
        "ffn_hidden_size": hf.get("n_inner"),
        "vocab_size": hf.get("vocab_size", 50257),
        "max_position_embeddings": hf.get("n_positions", 1024),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "hidden_dropout": float(hf.get("resid_pdrop", 0.1)),
        "attention_dropout": float(hf.get("attn_pdrop", 0.1)),
        "init_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
        "use_bias": True,
    }


def _llama_like_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
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
    if arch == "llama":
        bias = hf.get("attention_bias", False)
        if hf.get("mlp_bias", False) != bias:
            raise ModelFormatError(
                f"llama attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} is not supported; "
                "llmtrain's use_bias covers both"
            )
        defaults = {"eps": 1e-6, "theta": 10000.0, "tie": False, "max_pos": 2048, "head_dim": None}
    elif arch in ("ernie", "ernie_moe"):
        bias = hf.get("use_bias", False)
        head_dim = 128 if arch == "ernie" else None
        defaults = {"eps": 1e-5, "theta": 500000.0, "tie": True, "max_pos": 131072, "head_dim": head_dim}
    elif arch == "mixtral":
        bias = False
        defaults = {"eps": 1e-5, "theta": 1e6, "tie": False, "max_pos": 4096 * 32, "head_dim": None}
    else:
        if hf.get("attention_bias", False):
            raise ModelFormatError(
                "qwen3_moe attention_bias=True is not supported; llmtrain's qwen3_moe has no biases"
            )
        bias = False
        defaults = {"eps": 1e-6, "theta": 10000.0, "tie": False, "max_pos": 32768, "head_dim": None}
    heads = hf.get("num_attention_heads", 32)
    return {
        "num_layers": hf.get("num_hidden_layers", 32),
        "hidden_size": hf.get("hidden_size", 4096),
        "num_attention_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim", defaults["head_dim"]),
        "ffn_hidden_size": hf.get("intermediate_size", 11008),
        "vocab_size": hf.get("vocab_size", 32000),
        "max_position_embeddings": hf.get("max_position_embeddings", defaults["max_pos"]),
        "norm_eps": hf.get("rms_norm_eps", defaults["eps"]),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", defaults["theta"]))),
        "attention_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
        "init_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": hf.get("tie_word_embeddings", defaults["tie"]),
        "use_bias": bias,
    }


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
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
    return _deepseek_rope_fields(rope) | {
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
    }


def _deepseek_rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
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


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    model_type = hf["model_type"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mixtral") else None
    if window is not None:
        raise ModelFormatError(
            f"{model_type} sliding_window={window} is not supported; llmtrain attends over the whole sequence"
        )
    # Mixtral names the expert count num_local_experts; transformers writes Qwen3-MoE's under that name too.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    fields = {
        "num_experts": experts if experts is not None else (8 if arch == "mixtral" else 128),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2 if arch == "mixtral" else 8),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if arch == "ernie_moe":
        return fields | _ernie_moe_fields(hf)
    if arch == "mixtral":
        if hf.get("router_jitter_noise", 0.0):
            raise ModelFormatError(
                f"mixtral router_jitter_noise={hf['router_jitter_noise']} is not supported; set it to 0"
            )
        return fields
    return fields | {
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 768),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layer_interval": hf.get("decoder_sparse_step", 1),
        "dense_layers": sorted(hf.get("mlp_only_layers") or []),
    }


def _ernie_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("moe_norm_min", NORM_MIN) != NORM_MIN:
        raise ModelFormatError(
            f"ernie4_5_moe moe_norm_min={hf['moe_norm_min']} is not supported; llmtrain uses {NORM_MIN}"
        )
    layers = hf.get("num_hidden_layers", 32)
    end = hf.get("moe_layer_end_index", -1)
    end = layers - 1 if end is None or end == -1 else end
    return {
        "num_experts": hf.get("moe_num_experts", hf.get("num_experts", 64)),
        "num_experts_per_tok": hf.get("moe_k", hf.get("num_experts_per_tok", 6)),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 1536),
        "num_shared_experts": hf.get("moe_num_shared_experts") or 0,
        "moe_layer_start": hf.get("moe_layer_start_index", 1),
        "moe_layer_interval": hf.get("moe_layer_interval", 1),
        # ERNIE's end index becomes the dense layers after it.
        "dense_layers": list(range(end + 1, layers)),
    }


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json dict of the transformers model equivalent to `cfg` (error if none is)."""
    check_config(cfg)
    common = {
        "architectures": [HF_CLASSES[cfg.arch]],
        "model_type": ARCH_TO_MODEL_TYPE[cfg.arch],
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tied_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        # Token ids belong to the tokenizer, which a model config does not know.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if cfg.arch == "gpt":
        if (
            cfg.kv_heads != cfg.num_attention_heads
            or cfg.head_size * cfg.num_attention_heads != cfg.hidden_size
        ):
            raise ModelFormatError(
                "GPT-2 in transformers has no grouped-query attention or free head_dim; "
                "set model.num_kv_heads and model.head_dim to null to convert this gpt model"
            )
        if not cfg.bias:
            raise ModelFormatError(
                "GPT-2 in transformers always has biases; set model.use_bias to true to convert it"
            )
        return common | {
            "n_layer": cfg.num_layers,
            "n_embd": cfg.hidden_size,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size,  # null means 4 * n_embd in both
            "n_positions": cfg.max_positions,
            "layer_norm_epsilon": cfg.norm_eps,
            # The exact function our GPT MLP computes (gelu_new is the same curve, rounded differently).
            "activation_function": "gelu_pytorch_tanh",
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
        }
    if cfg.arch == "deepseek_v3":
        return common | _deepseek_hf_fields(cfg)
    fields = {
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
    if cfg.arch == "llama":
        fields |= {
            "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias,
            "attention_dropout": cfg.attention_dropout,
        }
    elif cfg.arch == "ernie":
        fields |= {"use_bias": cfg.bias}
    elif cfg.arch == "ernie_moe":
        fields |= _ernie_moe_hf_fields(cfg)
    else:
        fields |= _moe_hf_fields(cfg)
    return common | fields


def _deepseek_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
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
        "rope_parameters": _deepseek_rope_parameters(cfg),
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
        # llmtrain exports no multi-token-prediction modules.
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
    }


def _deepseek_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
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


def _ernie_moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
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
    return {
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


def _moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    moe = {
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        # Inference default; training with transformers adds the aux loss once this is turned on.
        "output_router_logits": False,
        "attention_dropout": cfg.attention_dropout,
    }
    if cfg.arch == "mixtral":
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
        return moe | {
            "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.expert_ffn_size,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    # Qwen3-MoE has no start index: the layers before moe_layer_start are listed as dense.
    dense = sorted(set(cfg.dense_layers) | set(range(min(cfg.moe_layer_start, cfg.num_layers))))
    return moe | {
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.expert_ffn_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.moe_layer_interval,
        "mlp_only_layers": dense,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


# ---------------------------------------------------------------- weight-name mapping


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Hugging Face tensors `hf` <-> llmtrain tensors `ours`, with the exact (lossless) maps both ways."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return ts


def _transpose(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].t().contiguous()]


def _concat(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(ts, dim=0)]


def _splitter(parts: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda ts: [t.contiguous() for t in ts[0].chunk(parts, dim=0)]


def _qkv_from_conv1d(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    # GPT-2's Conv1D stores (in, out); c_attn's out columns are [q | k | v].
    return [t.t().contiguous() for t in ts[0].chunk(3, dim=1)]


def _qkv_to_conv1d(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(ts, dim=0).t().contiguous()]


def _gated_mlp_rules(hf: str, ours: str, kinds: Sequence[str]) -> list[_Rule]:
    """A gated MLP under prefixes `hf` / `ours`: HF's gate_proj and up_proj fused into our gate_up_proj
    (concatenated in that order), down_proj renamed; for each of `kinds` (weight, bias)."""
    fused = [
        _Rule((f"{hf}gate_proj.{k}", f"{hf}up_proj.{k}"), (f"{ours}gate_up_proj.{k}",), _concat, _splitter(2))
        for k in kinds
    ]
    return fused + [_rename(f"{hf}down_proj.{k}", f"{ours}down_proj.{k}") for k in kinds]


def _rename(hf: str, ours: str) -> _Rule:
    return _Rule((hf,), (ours,), _same, _same)


def _stack_gate_up(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    # ts: gate_0, up_0, gate_1, up_1, ...: expert e's rows are [gate_e; up_e].
    return [torch.stack([torch.cat(ts[i : i + 2], dim=0) for i in range(0, len(ts), 2)])]


def _unstack_gate_up(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for expert in ts[0] for t in expert.chunk(2, dim=0)]


def _stack(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.stack(ts)]


def _unstack(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for t in ts[0]]


# Checkpoint names of one MoE layer's router and of expert e's (gate, up, down) projections.
_MOE_HF_NAMES = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        tuple(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        tuple(f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")),
    ),
}
_MOE_HF_NAMES["ernie_moe"] = _MOE_HF_NAMES["deepseek_v3"] = _MOE_HF_NAMES["qwen3_moe"]
# ERNIE's router score bias, shaped (1, experts), in the checkpoint and in transformers' memory.
_SCORE_BIAS = "mlp.moe_statics.e_score_correction_bias"
_SCORE_BIAS_IN_MEMORY = "mlp.gate.moe_statics.e_score_correction_bias"
# DeepSeek-V3's, shaped (experts,), under one name in both.
_DEEPSEEK_SCORE_BIAS = "mlp.gate.e_score_correction_bias"


def _row(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].reshape(1, -1)]


def _flat(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].reshape(-1)]


def _empty_shared_experts(cfg: ModelConfig, hf: str) -> _Rule:
    """transformers' DeepSeek-V3 always has a shared-experts MLP, of width 0 without shared experts: its empty
    tensors have no llmtrain counterpart."""
    h = cfg.hidden_size
    shapes = {"gate_proj": (0, h), "up_proj": (0, h), "down_proj": (h, 0)}
    return _Rule(
        tuple(f"{hf}{p}.weight" for p in shapes),
        (),
        lambda ts: [],
        lambda ts: [torch.empty(shape) for shape in shapes.values()],
    )


def _moe_rules(cfg: ModelConfig, h: str, o: str) -> list[_Rule]:
    router, (gate, up, down) = _MOE_HF_NAMES[cfg.arch]
    experts = range(cfg.num_experts)
    rules = []
    if cfg.arch == "deepseek_v3":
        rules.append(_rename(f"{h}{_DEEPSEEK_SCORE_BIAS}", f"{o}mlp.router.score_bias"))
    elif get_arch(cfg.arch).router_score_bias:
        rules.append(_Rule((f"{h}{_SCORE_BIAS}",), (f"{o}mlp.router.score_bias",), _flat, _row))
    if cfg.num_shared_experts:
        s, t = f"{h}mlp.shared_experts.", f"{o}mlp.shared_experts."
        rules += _gated_mlp_rules(s, t, ("weight",))
    elif cfg.arch == "deepseek_v3":
        rules.append(_empty_shared_experts(cfg, f"{h}mlp.shared_experts."))
    return rules + [
        _rename(f"{h}{router}", f"{o}mlp.router.weight"),
        _Rule(
            tuple(f"{h}{name.format(e=e)}" for e in experts for name in (gate, up)),
            (f"{o}mlp.experts.gate_up_proj",),
            _stack_gate_up,
            _unstack_gate_up,
        ),
        _Rule(
            tuple(f"{h}{down.format(e=e)}" for e in experts),
            (f"{o}mlp.experts.down_proj",),
            _stack,
            _unstack,
        ),
    ]


_STACKED_MOE_KEY = re.compile(
    r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)"
)


def _from_stacked_experts(cfg: ModelConfig, hf_state: Tensors) -> Tensors:
    """`hf_state` with transformers >= 5's in-memory MoE tensors (`mlp.gate.weight`,
    `mlp.experts.gate_up_proj` (experts, 2 * ffn, hidden), `mlp.experts.down_proj`) under their checkpoint
    names, one tensor per expert and projection; other tensors unchanged."""
    if cfg.arch not in _MOE_HF_NAMES:
        return hf_state
    router, (gate, up, down) = _MOE_HF_NAMES[cfg.arch]
    out: Tensors = {}
    for key, value in hf_state.items():
        match = _STACKED_MOE_KEY.fullmatch(key)
        if key.endswith(_SCORE_BIAS_IN_MEMORY):
            out[key.replace(_SCORE_BIAS_IN_MEMORY, _SCORE_BIAS)] = value
            continue
        if match is None:
            out[key] = value
            continue
        h, what = match.groups()
        if what == "gate.weight":
            out[f"{h}{router}"] = value
        elif what == "experts.gate_up_proj":
            halves = iter(_unstack_gate_up([value]))
            for e in range(value.shape[0]):
                out[f"{h}{gate.format(e=e)}"] = next(halves)
                out[f"{h}{up.format(e=e)}"] = next(halves)
        else:
            out.update((f"{h}{down.format(e=e)}", t) for e, t in enumerate(_unstack([value])))
    return out


def _latent_attention_rules(cfg: ModelConfig, hf: str, ours: str) -> list[_Rule]:
    """DeepSeek's multi-head latent attention (llmtrain.models.mla): renames only."""
    names = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_norm", "q_b_proj"]
    names += ["kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"]
    hf_names = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm"}
    return [_rename(f"{hf}{hf_names.get(n, n)}.weight", f"{ours}{n}.weight") for n in names]


def mapping(cfg: ModelConfig) -> list[_Rule]:
    """The weight-name mapping of `cfg`'s architecture, in llmtrain parameter order."""
    rules: list[_Rule] = []
    b = cfg.bias
    if cfg.arch == "gpt":
        rules += [
            _rename("transformer.wte.weight", "embed_tokens.weight"),
            _rename("transformer.wpe.weight", "embed_positions.weight"),
        ]
        for i in range(cfg.num_layers):
            h, o = f"transformer.h.{i}.", f"layers.{i}."
            qkv = tuple(f"{o}attn.{p}_proj" for p in "qkv")
            rules += [
                _rename(f"{h}ln_1.weight", f"{o}input_norm.weight"),
                _rename(f"{h}ln_1.bias", f"{o}input_norm.bias"),
                _Rule(
                    (f"{h}attn.c_attn.weight",),
                    tuple(f"{n}.weight" for n in qkv),
                    _qkv_from_conv1d,
                    _qkv_to_conv1d,
                ),
                _Rule((f"{h}attn.c_attn.bias",), tuple(f"{n}.bias" for n in qkv), _splitter(3), _concat),
                _Rule((f"{h}attn.c_proj.weight",), (f"{o}attn.o_proj.weight",), _transpose, _transpose),
                _rename(f"{h}attn.c_proj.bias", f"{o}attn.o_proj.bias"),
                _rename(f"{h}ln_2.weight", f"{o}post_attn_norm.weight"),
                _rename(f"{h}ln_2.bias", f"{o}post_attn_norm.bias"),
                _Rule((f"{h}mlp.c_fc.weight",), (f"{o}mlp.up_proj.weight",), _transpose, _transpose),
                _rename(f"{h}mlp.c_fc.bias", f"{o}mlp.up_proj.bias"),
                _Rule((f"{h}mlp.c_proj.weight",), (f"{o}mlp.down_proj.weight",), _transpose, _transpose),
                _rename(f"{h}mlp.c_proj.bias", f"{o}mlp.down_proj.bias"),
            ]
        rules += [
            _rename("transformer.ln_f.weight", "final_norm.weight"),
            _rename("transformer.ln_f.bias", "final_norm.bias"),
        ]
    else:
        rules.append(_rename("model.embed_tokens.weight", "embed_tokens.weight"))
        kinds = ("weight", "bias") if b else ("weight",)
        for i in range(cfg.num_layers):
            h, o = f"model.layers.{i}.", f"layers.{i}."
            rules.append(_rename(f"{h}input_layernorm.weight", f"{o}input_norm.weight"))
            if cfg.arch == "deepseek_v3":
                rules += _latent_attention_rules(cfg, f"{h}self_attn.", f"{o}attn.")
            else:
                rules += [
                    _rename(f"{h}self_attn.{p}_proj.{k}", f"{o}attn.{p}_proj.{k}")
                    for p in "qkvo"
                    for k in kinds
                ]
            if get_arch(cfg.arch).qk_norm:
                rules += [_rename(f"{h}self_attn.{p}_norm.weight", f"{o}attn.{p}_norm.weight") for p in "qk"]
            rules.append(_rename(f"{h}post_attention_layernorm.weight", f"{o}post_attn_norm.weight"))
            if cfg.is_moe_layer(i):
                rules += _moe_rules(cfg, h, o)
                continue
            rules += _gated_mlp_rules(f"{h}mlp.", f"{o}mlp.", kinds)
        rules.append(_rename("model.norm.weight", "final_norm.weight"))
    if not cfg.tied_embeddings:
        rules.append(_rename("lm_head.weight", "lm_head.weight"))
    return rules


def hf_to_llmtrain_state(
    cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], source: str = "state"
) -> Tensors:
    """llmtrain tensors (names as in `save_pretrained`) from a Hugging Face state dict of `cfg`."""
    hf_state = dict(hf_state)
    if cfg.arch == "gpt":
        # The original OpenAI checkpoints have no "transformer." prefix.
        hf_state = {
            k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
            for k, v in hf_state.items()
        }
    for key in [k for k in hf_state if IGNORED_HF_KEYS.search(k)]:
        del hf_state[key]
    if cfg.arch == "deepseek_v3":
        # DeepSeek-V3's multi-token-prediction modules come after the decoder layers; neither llmtrain nor
        # transformers' DeepseekV3ForCausalLM runs them.
        for key in [k for k in hf_state if _layer_index(k) >= cfg.num_layers]:
            del hf_state[key]
    if cfg.tied_embeddings:
        hf_state.pop("lm_head.weight", None)  # a tied head duplicates the embedding
    return _apply_rules(cfg, _from_stacked_experts(cfg, hf_state), source, to_hf=False)


def _layer_index(key: str) -> int:
    """The decoder layer a Hugging Face tensor name belongs to (-1 for none)."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else -1


def llmtrain_to_hf_state(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], source: str = "state"
) -> Tensors:
    """The Hugging Face state dict (without a tied lm_head, as transformers saves it) of llmtrain tensors."""
    state = dict(state)
    if cfg.tied_embeddings:
        state.pop("lm_head.weight", None)
    return _apply_rules(cfg, state, source, to_hf=True)


def _apply_rules(cfg: ModelConfig, state: Tensors, source: str, to_hf: bool) -> Tensors:
    """Every mapping rule of `cfg` applied in one direction; consumes `state`, which must then be empty."""
    out: Tensors = {}
    for rule in mapping(cfg):
        names, targets, convert = (
            (rule.ours, rule.hf, rule.to_hf) if to_hf else (rule.hf, rule.ours, rule.to_ours)
        )
        missing = [n for n in names if n not in state]
        if missing:
            raise ModelFormatError(
                f"{source}: missing tensor {missing[0]!r} for a {cfg.arch} model of this config"
            )
        out.update(zip(targets, convert([state.pop(n) for n in names]), strict=True))
    if state:
        raise ModelFormatError(
            f"{source}: unexpected tensors for a {cfg.arch} model of this config: {sorted(state)[:5]}"
        )
    return out


# ---------------------------------------------------------------- directories
def read_llmtrain(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, tensors) of an llmtrain model directory."""
    path = Path(path)
    cfg_file = path / LLMTRAIN_CONFIG
    try:
        raw = load_yaml(cfg_file.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ModelFormatError(f"{cfg_file} is unreadable ({err}); copy the model directory again") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ModelFormatError(f"{cfg_file}: expected a mapping with a 'model' section (a ModelConfig)")
    try:
        cfg = from_dict(ModelConfig, raw["model"], "model.")
        check_config(cfg)
    except ConfigError as err:
        raise ModelFormatError(f"{cfg_file}: {err}") from None
    return cfg, _read_weights(path / WEIGHTS)


def read_hf(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, Hugging Face-named tensors) of a Hugging Face model directory."""
    path = Path(path)
    cfg_file = path / HF_CONFIG
    try:
        cfg = from_hf_config(json.loads(cfg_file.read_text()))
    except (OSError, ValueError, ConfigError) as err:
        raise ModelFormatError(f"{cfg_file}: {err}") from None
    index = path / HF_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ModelFormatError(
                f"{index} is unreadable or has no weight_map ({err}); copy the model directory again"
            ) from None
        state: Tensors = {}
        for shard in shards:
            state.update(_read_weights(path / shard))
        return cfg, state
    return cfg, _read_weights(path / WEIGHTS)


def _read_weights(file: Path) -> Tensors:
    if not file.is_file():
        raise ModelFormatError(f"{file} does not exist; a model directory needs its safetensors weights")
    try:
        return load_file(file)
    except (OSError, SafetensorError) as err:
        raise ModelFormatError(
            f"{file} is not a readable safetensors file ({err}); copy the model directory again"
        ) from None


def detect_format(path: str | os.PathLike) -> str:
    """'llmtrain' or 'hf' by the config file present, or an error naming the files looked for."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(f"model directory {path} does not exist; check the path")
    if (path / LLMTRAIN_CONFIG).is_file():
        return "llmtrain"
    if (path / HF_CONFIG).is_file():
        return "hf"
    raise ModelFormatError(
        f"{path} is neither an llmtrain model directory ({LLMTRAIN_CONFIG} + {WEIGHTS}) "
        f"nor a Hugging Face one ({HF_CONFIG} + {WEIGHTS}); a training checkpoint loads with "
        "llmtrain.from_pretrained"
    )


def read_any(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, llmtrain-named tensors) of either kind of model directory."""
    if detect_format(path) == "llmtrain":
        return read_llmtrain(path)
    cfg, hf_state = read_hf(path)
    return cfg, hf_to_llmtrain_state(cfg, hf_state, source=str(path))


def model_from_state(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """A CausalLM holding `state` (llmtrain names); dtype defaults to the stored one."""
    dtype = dtype or state["embed_tokens.weight"].dtype
    model = empty_model(cfg, device).to(dtype)
    full = dict(state)
    if cfg.tied_embeddings:
        full["lm_head.weight"] = full["embed_tokens.weight"]
    model.load_state_dict(full, strict=True)
    return model


def from_pretrained(
    path: str | os.PathLike, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> CausalLM:
    """Load an llmtrain or Hugging Face model directory; eval mode, like transformers' from_pretrained."""
    cfg, state = read_any(path)
    return model_from_state(cfg, state, device, dtype).eval()


def model_state(model: CausalLM) -> Tensors:
    """The model's tensors as saved: detached, on CPU, contiguous, a tied lm_head left out."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tied_embeddings:
        del state["lm_head.weight"]
    return state


def write_llmtrain(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    tokenizer_files: Mapping[str, bytes] | None = None,
) -> None:
    """Write an llmtrain model directory atomically, with the tokenizer's files beside the weights."""
    check_config(cfg)
    with _atomic_dir(path) as tmp:
        (tmp / LLMTRAIN_CONFIG).write_text(dump_yaml({"model": dataclasses.asdict(cfg)}))
        save_safetensors(dict(state), tmp / WEIGHTS)
        _write_files(tmp, tokenizer_files or {})


def write_hf(
    cfg: ModelConfig,
    hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_files: Mapping[str, bytes] | None = None,
    token_ids: Mapping[str, int | None] | None = None,
) -> None:
    """Write a Hugging Face model directory atomically, as transformers' save_pretrained lays it out.

    `hf_tensors` (Hugging Face names) may be a generator: tensors are written as they come, in safetensors
    files of at most `max_shard_bytes` with a `model.safetensors.index.json` when there is more than one.
    `tokenizer_files` are written beside them, and `token_ids` (bos/eos/pad_token_id) go into config.json
    and generation_config.json.
    """
    items = hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors
    with _atomic_dir(path) as tmp:
        files: list[tuple[Path, list[str]]] = []
        part: Tensors = {}
        size = total = 0
        dtype = None
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if part and size + nbytes > max_shard_bytes:
                files.append(_write_part(part, tmp, len(files)))
                part, size = {}, 0
            part[name] = tensor.contiguous()
            dtype = dtype or tensor.dtype
            size += nbytes
            total += nbytes
        if part or not files:
            files.append(_write_part(part, tmp, len(files)))
        if len(files) == 1:
            files[0][0].rename(tmp / WEIGHTS)
        else:
            weight_map = {}
            for i, (file, names) in enumerate(files):
                name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                file.rename(tmp / name)
                weight_map.update(dict.fromkeys(names, name))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        hf_config = to_hf_config(cfg, dtype or torch.float32) | dict(token_ids or {})
        (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
        if token_ids:
            (tmp / GENERATION_CONFIG).write_text(json.dumps(dict(token_ids), indent=2) + "\n")
        _write_files(tmp, tokenizer_files or {})


def _write_part(part: Tensors, folder: Path, index: int) -> tuple[Path, list[str]]:
    file = folder / f"part-{index + 1}.safetensors"
    save_safetensors(part, file)
    return file, list(part)


def _write_files(folder: Path, files: Mapping[str, bytes]) -> None:
    for name, data in files.items():
        if (folder / name).exists():
            raise ModelFormatError(f"tokenizer file {name} would overwrite the model's own {name}")
        (folder / name).write_bytes(data)


def save_safetensors(tensors: Mapping[str, torch.Tensor], file: Path) -> None:
    """safetensors' save_file, leaving the file with the permissions any new file gets (0666 less the
    umask) instead of safetensors' private 0600: a model directory is for sharing."""
    file.touch()
    mode = stat.S_IMODE(file.stat().st_mode)
    save_file(dict(tensors), file, metadata={"format": "pt"})
    file.chmod(mode)


def save_pretrained(model: CausalLM, path: str | os.PathLike) -> None:
    """Save `model` as an llmtrain model directory."""
    write_llmtrain(model.config, model_state(model), path)


def save_hf(model: CausalLM, path: str | os.PathLike) -> None:
    """Save `model` as a Hugging Face directory that AutoModelForCausalLM.from_pretrained loads."""
    write_hf(model.config, llmtrain_to_hf_state(model.config, model_state(model)), path)


@contextlib.contextmanager
def _atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory to write into; on success it is renamed to `path`.

    An existing `path` is replaced only when it is empty or holds a model written before. The directory
    is made as any other (0777 less the umask), not private as tempfile makes it.
    """
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"output {path} exists and is not a directory; choose a new path")
        names = {p.name for p in path.iterdir()}
        if names and not names & {LLMTRAIN_CONFIG, HF_CONFIG}:
            raise ModelFormatError(
                f"output {path} is a non-empty directory that holds no model; choose a new path"
            )
    blocking = next((p for p in path.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ModelFormatError(f"output {path}: {blocking} is a file, not a directory; choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
