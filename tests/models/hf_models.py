"""Small random transformers models (the references the model zoo is checked against)."""

from __future__ import annotations

from typing import Any

import torch
import transformers

# Each config: (transformers class, config class, kwargs). Sizes are deliberately not powers of two and
# cover MHA, GQA with kv ratios 2 and 3, MQA, explicit head_dim != hidden/heads, tied/untied heads, biases,
# and both the eager and SDPA attention of transformers.
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "gpt": [
        dict(
            n_layer=2,
            n_embd=96,
            n_head=6,
            n_inner=200,
            vocab_size=1000,
            n_positions=40,
            activation_function="gelu_new",
            attn_implementation="eager",
        ),
        dict(n_layer=2, n_embd=64, n_head=4, vocab_size=523, n_positions=32, attn_implementation="sdpa"),
        dict(
            n_layer=3,
            n_embd=48,
            n_head=3,
            n_inner=72,
            vocab_size=777,
            n_positions=24,
            layer_norm_epsilon=1e-6,
            activation_function="gelu_pytorch_tanh",
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        ),
    ],
    "llama": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=200,
            vocab_size=1000,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            intermediate_size=120,
            vocab_size=611,
            rope_theta=500.0,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            intermediate_size=160,
            vocab_size=777,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=1,
            hidden_size=80,
            num_attention_heads=5,
            intermediate_size=96,
            vocab_size=300,
            attn_implementation="eager",
        ),
    ],
    "ernie": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=200,
            vocab_size=1000,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            intermediate_size=144,
            vocab_size=611,
            use_bias=True,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=2,
            hidden_size=80,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=144,
            vocab_size=777,
            attn_implementation="sdpa",
        ),
    ],
}

CLASSES = {
    "gpt": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "ernie": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
}

# No dropout; no padding_idx (it zeroes one embedding row's gradient); token ids inside small vocabularies.
COMMON = {
    "gpt": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
    "llama": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "ernie": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
}


def hf_model(arch: str, index: int, seed: int = 0) -> transformers.PreTrainedModel:
    """The transformers model of CONFIGS[arch][index] with random weights (biases and norms perturbed too)."""
    config_cls, model_cls = CLASSES[arch]
    config = config_cls(**COMMON[arch], **CONFIGS[arch][index])
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises biases to 0 and norms to 1, which would leave their mapping untested.
            is_norm = any(k in name for k in ("ln_", "norm", "layernorm")) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm else 0.05 * torch.randn_like(p))
    return model
