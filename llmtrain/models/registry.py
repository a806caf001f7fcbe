"""Architectures by name: which pluggable pieces the shared TransformerBlock uses for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]
RotaryKind = Literal["none", "half", "interleaved"]
AttentionKind = Literal["standard", "latent"]
RouterKind = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class ArchSpec:
    """The pieces that distinguish one architecture; sizes, bias and tying come from ModelConfig."""

    name: str
    norm: NormKind
    """layernorm (with bias) or rmsnorm."""
    mlp: MlpKind
    """gelu: up_proj -> gelu(tanh) -> down_proj; swiglu: gate_up_proj -> silu(gate) * up -> down_proj."""
    rotary: RotaryKind
    """none, half (NeoX / LLaMA: pairs (i, i + d/2)) or interleaved (GPT-J / ERNIE: pairs (2i, 2i + 1))."""
    learned_positions: bool
    """A learned position table added to the token embeddings (GPT-2)."""
    rope_fp32: bool
    """cos/sin stay fp32 whatever the activation dtype (ERNIE) instead of being cast to it (LLaMA)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before the rotary embedding (Qwen3)."""
    router_score_bias: bool = False
    """fp32 router scores, top-k chosen by score plus a per-expert bias that gradients do not train."""
    router: RouterKind = "softmax"
    """softmax (probabilities) or sigmoid (DeepSeek-V3: independent scores, group-limited, scaled) router."""
    attention: AttentionKind = "standard"
    """standard (grouped-query) or latent (DeepSeek's multi-head latent attention, llmtrain.models.mla)."""


ARCHS: dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    """Add an architecture to the registry; a name can be registered once."""
    if spec.name in ARCHS:
        raise ValueError(f"architecture {spec.name!r} is already registered")
    ARCHS[spec.name] = spec
    return spec


def get_arch(name: str) -> ArchSpec:
    """The registered architecture `name`, or an error listing the known ones."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(
            f"model.arch={name!r} is not a registered architecture; choose one of {sorted(ARCHS)}"
        ) from None


register_arch(
    ArchSpec("gpt", norm="layernorm", mlp="gelu", rotary="none", learned_positions=True, rope_fp32=False)
)
register_arch(
    ArchSpec("llama", norm="rmsnorm", mlp="swiglu", rotary="half", learned_positions=False, rope_fp32=False)
)
register_arch(
    ArchSpec(
        "ernie", norm="rmsnorm", mlp="swiglu", rotary="interleaved", learned_positions=False, rope_fp32=True
    )
)
# Mixtures of experts: which layers are MoE and the expert sizes come from ModelConfig (llmtrain.models.moe).
register_arch(
    ArchSpec("mixtral", norm="rmsnorm", mlp="swiglu", rotary="half", learned_positions=False, rope_fp32=False)
)
register_arch(
    ArchSpec(
        "qwen3_moe",
        norm="rmsnorm",
        mlp="swiglu",
        rotary="half",
        learned_positions=False,
        rope_fp32=False,
        qk_norm=True,
    )
)
register_arch(
    ArchSpec(
        "ernie_moe",
        norm="rmsnorm",
        mlp="swiglu",
        rotary="interleaved",
        learned_positions=False,
        rope_fp32=True,
        router_score_bias=True,
    )
)
register_arch(
    ArchSpec(
        "deepseek_v3",
        norm="rmsnorm",
        mlp="swiglu",
        rotary="interleaved",
        learned_positions=False,
        rope_fp32=False,
        router_score_bias=True,
        router="sigmoid",
        attention="latent",
    )
)
