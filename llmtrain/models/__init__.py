"""Model zoo: one shared transformer block, architectures registered by name, Hugging Face conversion."""

from llmtrain.models.causal_lm import CausalLM, build, check_config, empty_model
from llmtrain.models.hf import from_hf_config, from_pretrained, save_hf, save_pretrained, to_hf_config
from llmtrain.models.init import fill_region, init_kind, init_kinds, init_weights
from llmtrain.models.layers import Attention, GatedMLP, GeluMLP, LayerNorm, RMSNorm, TransformerBlock
from llmtrain.models.registry import ARCHS, ArchSpec, get_arch, register_arch

__all__ = [
    "ARCHS",
    "ArchSpec",
    "Attention",
    "CausalLM",
    "GatedMLP",
    "GeluMLP",
    "LayerNorm",
    "RMSNorm",
    "TransformerBlock",
    "build",
    "check_config",
    "empty_model",
    "fill_region",
    "from_hf_config",
    "from_pretrained",
    "get_arch",
    "init_kind",
    "init_kinds",
    "init_weights",
    "register_arch",
    "save_hf",
    "save_pretrained",
    "to_hf_config",
]
