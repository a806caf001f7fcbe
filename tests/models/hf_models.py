"""Small random transformers models (the references the model zoo is checked against)."""

from __future__ import annotations

from typing import Any

import torch
import transformers

# Each config: (transformers class, config class, kwargs). Sizes are deliberately not powers of two and
# cover MHA, GQA with kv ratios 2 and 3, MQA, explicit head_dim != hidden/heads, tied/untied heads, biases,
# and both the eager and SDPA attention of transformers. The mixtures of experts have odd expert counts
# (3, 5, 7), top-k 1, 2 and above, renormalised and raw top-k weights, dense layers between MoE layers
# (Qwen3's decoder_sparse_step and mlp_only_layers) and aux-loss coefficients large enough to show.
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
    "mixtral": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=80,
            num_local_experts=3,
            num_experts_per_tok=2,
            vocab_size=1000,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            intermediate_size=56,
            num_local_experts=5,
            num_experts_per_tok=1,
            vocab_size=611,
            rope_theta=500.0,
            tie_word_embeddings=True,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=3,
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=5,
            intermediate_size=48,
            num_local_experts=7,
            num_experts_per_tok=4,
            vocab_size=777,
            router_aux_loss_coef=0.05,
            attn_implementation="sdpa",
        ),
    ],
    "qwen3_moe": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=200,
            moe_intermediate_size=40,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            vocab_size=1000,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            intermediate_size=120,
            moe_intermediate_size=32,
            num_experts=3,
            num_experts_per_tok=1,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            vocab_size=611,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=4,
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=5,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_experts=7,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            router_aux_loss_coef=0.05,
            tie_word_embeddings=True,
            vocab_size=777,
            attn_implementation="sdpa",
        ),
    ],
    # ERNIE-4.5-MoE: shared experts off (0) and on (2, 1), dense layers before moe_layer_start_index, between
    # MoE layers (interval 2) and after moe_layer_end_index; its e_score_correction_bias is perturbed by
    # hf_model like every parameter, so the biased top-k choice differs from the plain one.
    "ernie_moe": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=200,
            moe_intermediate_size=40,
            moe_num_experts=5,
            moe_k=2,
            moe_num_shared_experts=0,
            moe_layer_start_index=0,
            vocab_size=1000,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            intermediate_size=120,
            moe_intermediate_size=32,
            moe_num_experts=3,
            moe_k=1,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            tie_word_embeddings=False,
            vocab_size=611,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=5,
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=5,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=24,
            moe_num_experts=7,
            moe_k=3,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=2,
            moe_layer_end_index=3,
            router_aux_loss_coef=0.05,
            vocab_size=777,
            attn_implementation="sdpa",
        ),
    ],
    # DeepSeek-V3: YaRN and default rotary, full and low-rank queries, value heads narrower and wider than
    # query/key heads, shared experts off (0) and on (1, 2), group-limited routing (9 experts in 3 groups, 2
    # chosen), dense layers before first_k_dense_replace; its e_score_correction_bias buffer is perturbed by
    # hf_model.
    "deepseek_v3": [
        dict(
            num_hidden_layers=2,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=6,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            intermediate_size=200,
            moe_intermediate_size=40,
            n_routed_experts=5,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            # YaRN as DeepSeek extends its context, with an original context shorter than the test sequence.
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            max_position_embeddings=640,
            vocab_size=1000,
            attn_implementation="eager",
        ),
        dict(
            num_hidden_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=16,
            v_head_dim=32,
            intermediate_size=120,
            moe_intermediate_size=32,
            n_routed_experts=9,
            num_experts_per_tok=1,
            n_shared_experts=0,
            n_group=3,
            topk_group=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            vocab_size=611,
            attn_implementation="sdpa",
        ),
        dict(
            num_hidden_layers=4,
            hidden_size=80,
            num_attention_heads=5,
            num_key_value_heads=5,
            q_lora_rank=40,
            kv_lora_rank=20,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=8,
            intermediate_size=96,
            moe_intermediate_size=24,
            n_routed_experts=7,
            num_experts_per_tok=4,
            n_shared_experts=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.7,
            first_k_dense_replace=2,
            tie_word_embeddings=True,
            vocab_size=777,
            attn_implementation="sdpa",
        ),
    ],
}

CLASSES = {
    "gpt": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "ernie": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "ernie_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
}

# No dropout; no padding_idx (it zeroes one embedding row's gradient); token ids inside small vocabularies.
COMMON = {
    "gpt": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
    "llama": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "ernie": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "mixtral": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "qwen3_moe": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "ernie_moe": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "deepseek_v3": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, num_mtp_layers=0),
}

MOE_ARCHS = ("mixtral", "qwen3_moe", "ernie_moe", "deepseek_v3")
# The mixtures of experts whose transformers class computes the load-balancing loss (DeepSeek-V3's has none).
AUX_LOSS_ARCHS = ("mixtral", "qwen3_moe", "ernie_moe")


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
            # Frozen tensors too (ERNIE's e_score_correction_bias): under no_grad copy_ ignores requires_grad.
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm else 0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router score bias is a buffer
                b.copy_(0.05 * torch.randn_like(b))
    return model
