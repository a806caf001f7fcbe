"""DeepSeek-V3's multi-token prediction modules to and from the Hugging Face layout (the published
checkpoint's names: decoder layer num_hidden_layers + k with enorm, hnorm, eh_proj, shared_head.norm and the
copies embed_tokens and shared_head.head), bitwise both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmtrain.config import ModelConfig
from llmtrain.models import build, from_pretrained, save_hf
from llmtrain.models.hf import HF_CONFIG, WEIGHTS, ModelFormatError, read_hf
from llmtrain.models.hf.conversion import hf_to_llmtrain_state, llmtrain_to_hf_state, model_state

DEEPSEEK = dict(
    arch="deepseek_v3", num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
    vocab_size=61, seq_length=12, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=16, num_shared_experts=1, moe_layer_start=1,
    mtp_layers=2,
)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trips_are_bitwise_in_the_published_layout(tied: bool, tmp_path: Path) -> None:
    model = build(ModelConfig(**DEEPSEEK, tie_word_embeddings=tied), seed=5)
    save_hf(model, tmp_path)
    cfg, hf = read_hf(tmp_path)
    assert cfg.mtp_layers == 2
    for k, layer in enumerate((2, 3)):
        ours, h = f"mtp.layers.{k}.", f"model.layers.{layer}."
        assert torch.equal(hf[f"{h}eh_proj.weight"], model.state_dict()[f"{ours}eh_proj.weight"])
        assert torch.equal(hf[f"{h}shared_head.norm.weight"], model.state_dict()[f"{ours}final_norm.weight"])
        for name in ("enorm.weight", "hnorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "mlp.gate.e_score_correction_bias", "mlp.experts.3.down_proj.weight"):  # fmt: skip
            assert f"{h}{name}" in hf
        assert torch.equal(hf[f"{h}embed_tokens.weight"], model.embed_tokens.weight.detach())
        assert torch.equal(hf[f"{h}shared_head.head.weight"], model.lm_head.weight.detach())
    # HF -> llmtrain -> HF and llmtrain -> HF -> llmtrain, bit for bit.
    back = llmtrain_to_hf_state(cfg, hf_to_llmtrain_state(cfg, dict(hf)))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    loaded = model_state(from_pretrained(tmp_path))
    state = model_state(model)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_checkpoints_without_the_modules_and_differing_copies(tmp_path: Path) -> None:
    model = build(ModelConfig(**DEEPSEEK), seed=5)
    save_hf(model, tmp_path)
    _, hf = read_hf(tmp_path)
    # transformers' DeepseekV3ForCausalLM saves no MTP layers whatever num_nextn_predict_layers says.
    save_file({k: v for k, v in hf.items() if not k.startswith(("model.layers.2.", "model.layers.3."))},
              tmp_path / WEIGHTS)  # fmt: skip
    assert '"num_nextn_predict_layers": 2' in (tmp_path / HF_CONFIG).read_text()
    assert from_pretrained(tmp_path).mtp is None
    hf["model.layers.3.embed_tokens.weight"] = hf["model.layers.3.embed_tokens.weight"] + 1
    save_file(hf, tmp_path / WEIGHTS)
    with pytest.raises(ModelFormatError, match="model.layers.3.embed_tokens.weight differs from"):
        from_pretrained(tmp_path)
