"""The generic conversion every family goes through: config.json <-> ModelConfig, Hugging Face state dict
<-> llmtrain tensors by the family's rules (llmtrain.models.hf.registry), and llmtrain tensors <-> CausalLM.

The conversion is pure renaming, transposing, splitting and concatenating, so round trips are bitwise."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.causal_lm import CausalLM, check_config, empty_model
from llmtrain.models.hf.adapter import ModelFormatError, Rule, Tensors, rename
from llmtrain.models.hf.registry import adapter_for_arch, adapter_for_model_type

# Buffers some checkpoints carry (GPT-2 causal masks, old LLaMA inv_freq): recomputed, not loaded.
IGNORED_HF_KEYS = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def from_hf_config(hf_config: Mapping[str, Any] | Any) -> ModelConfig:
    """ModelConfig of a transformers config (object or config.json dict) of a model type in
    MODEL_TYPE_TO_ARCH."""
    hf = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    adapter = adapter_for_model_type(hf.get("model_type"))
    fields = adapter.config_fields(hf)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    if fields.get("num_kv_heads") == heads:
        fields["num_kv_heads"] = None
    if fields.get("head_dim") is not None and hidden % heads == 0 and fields["head_dim"] == hidden // heads:
        fields["head_dim"] = None
    fields["seq_length"] = min(ModelConfig.seq_length, fields["max_position_embeddings"])
    cfg = ModelConfig(arch=adapter.arch, **fields)
    check_config(cfg)
    return cfg


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json dict of the transformers model equivalent to `cfg` (error if none is)."""
    check_config(cfg)
    adapter = adapter_for_arch(cfg.arch)
    common = {
        "architectures": [adapter.hf_class],
        "model_type": adapter.model_type,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tied_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        # Token ids belong to the tokenizer, which a model config does not know.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    return common | adapter.hf_config_fields(cfg)


def mapping(cfg: ModelConfig) -> list[Rule]:
    """The weight-name mapping of `cfg`'s architecture, in llmtrain parameter order."""
    rules = adapter_for_arch(cfg.arch).rules(cfg)
    if not cfg.tied_embeddings and not any("lm_head.weight" in rule.ours for rule in rules):
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    return rules


def hf_to_llmtrain_state(
    cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], source: str = "state"
) -> Tensors:
    """llmtrain tensors (names as in `save_pretrained`) from a Hugging Face state dict of `cfg`."""
    hf_state = {k: v for k, v in hf_state.items() if not IGNORED_HF_KEYS.search(k)}
    if cfg.tied_embeddings:
        hf_state.pop("lm_head.weight", None)  # a tied head duplicates the embedding
    hf_state = adapter_for_arch(cfg.arch).checkpoint_names(cfg, hf_state)
    return _apply_rules(cfg, hf_state, source, to_hf=False)


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


def model_state(model: CausalLM) -> Tensors:
    """The model's tensors as saved: detached, on CPU, contiguous, a tied lm_head left out."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tied_embeddings:
        del state["lm_head.weight"]
    return state
