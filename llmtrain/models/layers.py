"""The shared transformer block and its pluggable pieces (norms, attention, MLPs).

Module and attribute names are a contract: tensor parallelism replaces the projections by name and
reads/rewrites the LOCAL head counts (`num_heads`, `num_kv_heads`), so forward code derives every
shape from those attributes and the tensors, never from the global config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from llmtrain.config import ModelConfig
from llmtrain.models.documents import document_attention
from llmtrain.models.mla import LatentAttention
from llmtrain.models.moe import MoEMLP
from llmtrain.models.norms import LayerNorm, RMSNorm
from llmtrain.models.registry import ArchSpec
from llmtrain.models.rope import rotate

Rope = tuple[torch.Tensor, torch.Tensor] | None
"""Rotary (cos, sin): (s, head_dim) shared by the batch, or (b, s, head_dim) per sample (packed documents)."""


def make_norm(spec: ArchSpec, cfg: ModelConfig) -> RMSNorm | LayerNorm:
    """The architecture's normalisation layer over hidden_size."""
    cls = LayerNorm if spec.norm == "layernorm" else RMSNorm
    return cls(cfg.hidden_size, cfg.norm_eps, cfg.kernels)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and an optional rotary embedding."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_size
        self.rotary = spec.rotary
        self.dropout_p = cfg.attention_dropout
        self.impl = cfg.kernels
        h, d = cfg.hidden_size, cfg.head_size
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.bias)
        self.q_norm = RMSNorm(d, cfg.norm_eps, cfg.kernels) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps, cfg.kernels) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` (b, S): packed documents' ids of the whole sequences (llmtrain.models.documents)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if rope is not None:
            cos, sin = rope
            interleaved = self.rotary == "interleaved"
            q = rotate(q, cos, sin, interleaved, self.impl)
            k = rotate(k, cos, sin, interleaved, self.impl)
        # (b, s, heads, d) -> (b, heads, s, d) as strided views: SDPA takes them without a copy.
        context = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.o_proj(context.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention: q (b, heads, s, d), k/v (b, kv_heads, s, d) -> context (b, heads, s, d); with
        `documents` (b, s) only inside each packed document."""
        if documents is not None:
            return document_attention(q, k, v, documents, self.dropout_p if self.training else 0.0)
        if self.training and self.dropout_p > 0:
            # kernels.flash_attention has no dropout; attention dropout is a rarely used pretraining option.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
            )
        return kernels.flash_attention(q, k, v, causal=True, impl=self.impl)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused: gate_up_proj rows [0:ffn] gate, [ffn:2ffn] up."""

    def __init__(self, cfg: ModelConfig, ffn_size: int | None = None) -> None:
        super().__init__()
        self.impl = cfg.kernels
        ffn = ffn_size or cfg.ffn_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ffn, bias=cfg.bias)
        self.down_proj = nn.Linear(ffn, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(kernels.swiglu(gate, up, impl=self.impl))


class GeluMLP(nn.Module):
    """GPT-2 MLP: up_proj, gelu (tanh approximation), down_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


def make_mlp(spec: ArchSpec, cfg: ModelConfig, layer_index: int) -> GatedMLP | GeluMLP | MoEMLP:
    """The MLP of block `layer_index`: routed experts where the config makes it an MoE layer."""
    if cfg.is_moe_layer(layer_index):
        shared = cfg.num_shared_experts * cfg.expert_ffn_size
        return MoEMLP(spec, cfg, GatedMLP(cfg, shared) if shared else None)
    return GatedMLP(cfg) if spec.mlp == "swiglu" else GeluMLP(cfg)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(input_norm(x)), then x + mlp(post_attn_norm(x))."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_norm = make_norm(spec, cfg)
        self.attn = LatentAttention(cfg) if spec.attention == "latent" else Attention(spec, cfg)
        self.post_attn_norm = make_norm(spec, cfg)
        self.mlp = make_mlp(spec, cfg, layer_index)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: Rope, documents: torch.Tensor | None = None) -> torch.Tensor:
        # post_attn_norm also forms the residual stream x + attn(...), in one pass with the Triton kernel.
        attended = self._drop(self.attn(self.input_norm(x), rope, documents))
        normed, x = self.post_attn_norm(attended, residual=x)
        return x + self._drop(self.mlp(normed))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Skipping a p=0 dropout saves a full read/write of the activations in training mode.
        return self.dropout(x) if self.dropout.p > 0 else x
