"""GPT-2 (transformers' GPT2LMHeadModel) <-> llmtrain's `gpt`: config translation and weight rules.

GPT-2 stores its linear layers as Conv1D, (in, out), with q, k and v fused in one c_attn."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import (
    HFAdapter,
    ModelFormatError,
    Rule,
    Tensors,
    concat,
    rename,
    splitter,
    transpose,
)

# GPT-2's "gelu_new" and these aliases are all the tanh approximation our GPT MLP computes.
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh")


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config (defaults: GPT-2 small's) -> ModelConfig fields."""
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


def hf_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """GPT2Config fields of a gpt config (which must have full multi-head attention and biases)."""
    if cfg.kv_heads != cfg.num_attention_heads or cfg.head_size * cfg.num_attention_heads != cfg.hidden_size:
        raise ModelFormatError(
            "GPT-2 in transformers has no grouped-query attention or free head_dim; "
            "set model.num_kv_heads and model.head_dim to null to convert this gpt model"
        )
    if not cfg.bias:
        raise ModelFormatError(
            "GPT-2 in transformers always has biases; set model.use_bias to true to convert it"
        )
    return {
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


def _qkv_from_conv1d(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    # GPT-2's Conv1D stores (in, out); c_attn's out columns are [q | k | v].
    return [t.t().contiguous() for t in ts[0].chunk(3, dim=1)]


def _qkv_to_conv1d(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(ts, dim=0).t().contiguous()]


def rules(cfg: ModelConfig) -> list[Rule]:
    """GPT-2's weight names: `transformer.h.N.` layers of Conv1D weights."""
    rules = [
        rename("transformer.wte.weight", "embed_tokens.weight"),
        rename("transformer.wpe.weight", "embed_positions.weight"),
    ]
    for i in range(cfg.num_layers):
        h, o = f"transformer.h.{i}.", f"layers.{i}."
        qkv = tuple(f"{o}attn.{p}_proj" for p in "qkv")
        rules += [
            rename(f"{h}ln_1.weight", f"{o}input_norm.weight"),
            rename(f"{h}ln_1.bias", f"{o}input_norm.bias"),
            Rule(
                (f"{h}attn.c_attn.weight",),
                tuple(f"{n}.weight" for n in qkv),
                _qkv_from_conv1d,
                _qkv_to_conv1d,
            ),
            Rule((f"{h}attn.c_attn.bias",), tuple(f"{n}.bias" for n in qkv), splitter(3), concat),
            Rule((f"{h}attn.c_proj.weight",), (f"{o}attn.o_proj.weight",), transpose, transpose),
            rename(f"{h}attn.c_proj.bias", f"{o}attn.o_proj.bias"),
            rename(f"{h}ln_2.weight", f"{o}post_attn_norm.weight"),
            rename(f"{h}ln_2.bias", f"{o}post_attn_norm.bias"),
            Rule((f"{h}mlp.c_fc.weight",), (f"{o}mlp.up_proj.weight",), transpose, transpose),
            rename(f"{h}mlp.c_fc.bias", f"{o}mlp.up_proj.bias"),
            Rule((f"{h}mlp.c_proj.weight",), (f"{o}mlp.down_proj.weight",), transpose, transpose),
            rename(f"{h}mlp.c_proj.bias", f"{o}mlp.down_proj.bias"),
        ]
    return rules + [
        rename("transformer.ln_f.weight", "final_norm.weight"),
        rename("transformer.ln_f.bias", "final_norm.bias"),
    ]


def checkpoint_names(cfg: ModelConfig, hf_state: Tensors) -> Tensors:
    """The original OpenAI checkpoints have no "transformer." prefix."""
    prefixed = ("transformer.", "lm_head.")
    return {k if k.startswith(prefixed) else f"transformer.{k}": v for k, v in hf_state.items()}


ADAPTER = HFAdapter(
    arch="gpt",
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    config_fields=config_fields,
    hf_config_fields=hf_config_fields,
    rules=rules,
    checkpoint_names=checkpoint_names,
)
