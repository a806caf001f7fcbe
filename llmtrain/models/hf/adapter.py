"""What a model family's Hugging Face adapter provides (`HFAdapter`), and the weight-mapping primitives
(`Rule` and the exact tensor maps) every family builds its rules from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.errors import UserError

Tensors = dict[str, torch.Tensor]
TensorMap = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class ModelFormatError(UserError, ValueError):
    """A model directory or config cannot be read, written or converted; the message names the file or
    field and the fix."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hugging Face tensors `hf` <-> llmtrain tensors `ours`, with the exact (lossless) maps both ways."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: TensorMap
    to_hf: TensorMap


def _keep_names(cfg: ModelConfig, hf_state: Tensors) -> Tensors:
    return hf_state


def _keep_config(cfg: ModelConfig, hf_state: Tensors) -> ModelConfig:
    return cfg


@dataclasses.dataclass(frozen=True)
class HFAdapter:
    """One llmtrain architecture (`arch`) and its transformers counterpart: the two config translations and
    the weight-name mapping. The generic conversion (llmtrain.models.hf.conversion) does the rest: the
    config fields every family shares, dropping recomputed buffers and a tied lm_head, applying the rules."""

    arch: str
    """ModelConfig.arch, as registered in llmtrain.models.registry."""
    model_type: str
    """config.json's model_type."""
    hf_class: str
    """The transformers class, config.json's architectures[0]."""
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    """config.json dict -> ModelConfig fields (arch and seq_length excepted); raises ModelFormatError for
    what llmtrain does not implement."""
    hf_config_fields: Callable[[ModelConfig], dict[str, Any]]
    """ModelConfig -> the family's config.json fields (the shared ones, vocab_size, dtype, token ids, ... are
    added around them); raises ModelFormatError for what transformers' class cannot express."""
    rules: Callable[[ModelConfig], list[Rule]]
    """The weight-name mapping of a config, in llmtrain parameter order, without the untied lm_head."""
    checkpoint_names: Callable[[ModelConfig, Tensors], Tensors] = _keep_names
    """A Hugging Face state dict with the names `rules` expect: e.g. transformers >= 5's stacked in-memory
    experts split per expert, tensors transformers does not run dropped."""
    state_config: Callable[[ModelConfig, Tensors], ModelConfig] = _keep_config
    """config.json's config -> the one a checkpoint's tensors hold (DeepSeek-V3: its MTP layers only where
    the checkpoint has them)."""


def same(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return ts


def transpose(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [ts[0].t().contiguous()]


def concat(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(ts, dim=0)]


def splitter(parts: int) -> TensorMap:
    return lambda ts: [t.contiguous() for t in ts[0].chunk(parts, dim=0)]


def stack(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.stack(ts)]


def unstack(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for t in ts[0]]


def rename(hf: str, ours: str) -> Rule:
    """The same tensor under two names."""
    return Rule((hf,), (ours,), same, same)


def gated_mlp_rules(hf: str, ours: str, kinds: Sequence[str]) -> list[Rule]:
    """A gated MLP under prefixes `hf` / `ours`: HF's gate_proj and up_proj fused into our gate_up_proj
    (concatenated in that order), down_proj renamed; for each of `kinds` (weight, bias)."""
    fused = [
        Rule((f"{hf}gate_proj.{k}", f"{hf}up_proj.{k}"), (f"{ours}gate_up_proj.{k}",), concat, splitter(2))
        for k in kinds
    ]
    return fused + [rename(f"{hf}down_proj.{k}", f"{ours}down_proj.{k}") for k in kinds]
