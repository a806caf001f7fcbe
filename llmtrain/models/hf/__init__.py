"""Hugging Face interop: config translation, weight-name mapping, load and save of model directories.

One adapter per model family (`gpt`, `llama`, `ernie` (ERNIE-4.5 dense and MoE), `mixtral`, `qwen3_moe`,
`deepseek_v3`) holds that family's config translation and weight rules, built from the shared pieces in
`adapter` (the interface and tensor maps), `decoder` (the LLaMA-style layout) and `moe` (experts);
`registry` lists the adapters, `conversion` applies them, `directories` reads and writes model directories.
Adding a family: docs/adding-a-model-family.md. transformers itself is not needed here.
"""

from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError, Rule, Tensors
from llmtrain.models.hf.conversion import (
    IGNORED_HF_KEYS,
    from_hf_config,
    hf_to_llmtrain_state,
    llmtrain_to_hf_state,
    mapping,
    model_from_state,
    model_state,
    to_hf_config,
)
from llmtrain.models.hf.directories import (
    DEFAULT_MAX_SHARD_BYTES,
    GENERATION_CONFIG,
    HF_CONFIG,
    HF_INDEX,
    LLMTRAIN_CONFIG,
    WEIGHTS,
    detect_format,
    from_pretrained,
    read_any,
    read_config,
    read_hf,
    read_llmtrain,
    save_hf,
    save_pretrained,
    save_safetensors,
    write_hf,
    write_llmtrain,
)
from llmtrain.models.hf.gpt import GELU_TANH
from llmtrain.models.hf.registry import ADAPTERS, ARCH_TO_MODEL_TYPE, HF_CLASSES, MODEL_TYPE_TO_ARCH

__all__ = [
    "ADAPTERS",
    "ARCH_TO_MODEL_TYPE",
    "DEFAULT_MAX_SHARD_BYTES",
    "GELU_TANH",
    "GENERATION_CONFIG",
    "HF_CLASSES",
    "HF_CONFIG",
    "HF_INDEX",
    "IGNORED_HF_KEYS",
    "LLMTRAIN_CONFIG",
    "MODEL_TYPE_TO_ARCH",
    "WEIGHTS",
    "HFAdapter",
    "ModelFormatError",
    "Rule",
    "Tensors",
    "detect_format",
    "from_hf_config",
    "from_pretrained",
    "hf_to_llmtrain_state",
    "llmtrain_to_hf_state",
    "mapping",
    "model_from_state",
    "model_state",
    "read_any",
    "read_config",
    "read_hf",
    "read_llmtrain",
    "save_hf",
    "save_pretrained",
    "save_safetensors",
    "to_hf_config",
    "write_hf",
    "write_llmtrain",
]
