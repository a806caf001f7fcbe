"""The Hugging Face adapters by llmtrain architecture and by config.json model_type: the one table a new
family is added to. (Which pieces an architecture's model is built from is llmtrain.models.registry.)"""

from __future__ import annotations

from llmtrain.models.hf import deepseek_v3, ernie, gpt, llama, mixtral, qwen3_moe
from llmtrain.models.hf.adapter import HFAdapter, ModelFormatError

ADAPTERS: dict[str, HFAdapter] = {
    adapter.arch: adapter
    for adapter in (
        gpt.ADAPTER,
        llama.ADAPTER,
        ernie.ADAPTER,
        mixtral.ADAPTER,
        qwen3_moe.ADAPTER,
        ernie.MOE_ADAPTER,
        deepseek_v3.ADAPTER,
    )
}
MODEL_TYPE_TO_ARCH = {adapter.model_type: arch for arch, adapter in ADAPTERS.items()}
ARCH_TO_MODEL_TYPE = {arch: adapter.model_type for arch, adapter in ADAPTERS.items()}
HF_CLASSES = {arch: adapter.hf_class for arch, adapter in ADAPTERS.items()}


def adapter_for_model_type(model_type: object) -> HFAdapter:
    """The adapter of a config.json's model_type, or an error listing the supported ones."""
    if model_type not in MODEL_TYPE_TO_ARCH:
        raise ModelFormatError(
            f"model_type={model_type!r} is not supported; supported Hugging Face model types: "
            f"{', '.join(MODEL_TYPE_TO_ARCH)}"
        )
    return ADAPTERS[MODEL_TYPE_TO_ARCH[model_type]]


def adapter_for_arch(arch: str) -> HFAdapter:
    """The adapter of an llmtrain architecture, or an error naming the ones transformers has."""
    if arch not in ADAPTERS:
        raise ModelFormatError(
            f"model.arch={arch!r} has no Hugging Face counterpart; convertible architectures: "
            f"{', '.join(ADAPTERS)}"
        )
    return ADAPTERS[arch]
