"""Packed documents (data.reset_attention_mask) through DeepSeek-V3's multi-head latent attention: a packed
sequence gives each document the logits it gets when run alone, in float64."""

from __future__ import annotations

import pytest

from llmtrain.config import ModelConfig, load
from tests.models._packed import assert_packed_documents_equal_separate_runs

SMALL = dict(
    arch="deepseek_v3",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=24,
    kv_lora_rank=12,
    qk_rope_head_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_ffn_hidden_size=16,
    num_shared_experts=1,
    moe_layer_start=1,
    kernels="torch",
)
# The attention core pads the narrower of q/k and v: values narrower (8 + 4 > 8) and wider (4 + 4 < 12);
# a low-rank and a full-rank query; YaRN, whose softmax scale and cos/sin factor differ from the default's.
CASES = [
    dict(q_lora_rank=12, qk_nope_head_dim=8, v_head_dim=8),
    dict(
        q_lora_rank=None,
        qk_nope_head_dim=4,
        v_head_dim=12,
        rope_scaling="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_positions=8,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=["low-rank query", "full query, yarn"])
def test_packed_documents_equal_separate_runs(case: dict) -> None:
    assert_packed_documents_equal_separate_runs(ModelConfig(**SMALL, **case))


def test_deepseek_accepts_packed_documents() -> None:
    job = load(None, ["model.arch=deepseek_v3", "data.reset_attention_mask=true"])
    assert job.data.reset_attention_mask
