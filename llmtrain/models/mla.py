"""Multi-head latent attention (DeepSeek-V2/V3): keys and values rebuilt per head from one low-rank latent.

Per token: the query is `q_proj(x)`, or `q_b_proj(norm(q_a_proj(x)))` with a query rank (q_lora_rank);
`kv_a_proj_with_mqa(x)` gives the key/value latent (kv_lora_rank) and one rotary key part of qk_rope_head_dim
shared by every head; `kv_b_proj(norm(latent))` gives each head's key part without rotary (qk_nope_head_dim)
and its value (v_head_dim). A head's query and key are [nope | rope], scaled by 1/sqrt(nope + rope) (times
YaRN's softmax factor, llmtrain.models.rope).

The rotary embedding turns interleaved pairs (2i, 2i + 1), as DeepSeek's checkpoints lay them out.
transformers' `rope_interleave` code writes the turned pairs back de-interleaved; queries and keys are
permuted alike, so their dot products, and everything after, are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from llmtrain.config import ModelConfig
from llmtrain.models.documents import document_attention
from llmtrain.models.norms import RMSNorm
from llmtrain.models.rope import rotate, softmax_scale_factor

LATENT_NORM_EPS = 1e-6
"""Epsilon of the query and key/value latent norms: DeepSeek's fixed value, not model.norm_eps."""


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; `core` is the part selective recompute wraps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.dropout_p = cfg.attention_dropout
        self.impl = cfg.kernels
        qk = self.nope_dim + self.rope_dim
        self.softmax_scale = qk**-0.5 * softmax_scale_factor(cfg)
        rank = cfg.q_lora_rank
        self.q_proj = nn.Linear(h, heads * qk, bias=False) if rank is None else None
        self.q_a_proj = nn.Linear(h, rank, bias=False) if rank is not None else None
        self.q_a_norm = RMSNorm(rank, LATENT_NORM_EPS, cfg.kernels) if rank is not None else None
        self.q_b_proj = nn.Linear(rank, heads * qk, bias=False) if rank is not None else None
        self.kv_a_proj = nn.Linear(h, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, cfg.kernels)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`documents` (b, s): packed documents' ids (llmtrain.models.documents); `rope` then holds per-sample
        tables of the positions inside each document."""
        b, s, _ = x.shape
        query = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = query.view(b, s, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(b, s, self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        cos, sin = rope
        q_rope = rotate(q_rope, cos, sin, interleaved=True, impl=self.impl)
        k_rope = rotate(k_rope.unsqueeze(2), cos, sin, interleaved=True, impl=self.impl)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.num_heads, -1)], dim=-1)
        context = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.o_proj(context.transpose(1, 2).reshape(b, s, self.num_heads * self.v_dim))

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention: q/k (b, heads, s, nope + rope), v (b, heads, s, v_dim) -> (b, heads, s, v_dim);
        with `documents` (b, s) only inside each packed document.

        The attention kernels take one head width, so the narrower of q/k and v is padded with zeros
        (zeros add nothing to a dot product; the padded output columns are dropped)."""
        qk, vd = q.shape[-1], v.shape[-1]
        if vd < qk:
            v = F.pad(v, (0, qk - vd))
        elif qk < vd:
            q, k = F.pad(q, (0, vd - qk)), F.pad(k, (0, vd - qk))
        return self.attention(q, k, v, documents)[..., :vd]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`core`'s attention of equal-width heads at softmax_scale; context parallelism replaces it."""
        p, scale = (self.dropout_p if self.training else 0.0), self.softmax_scale
        if documents is not None:
            return document_attention(q, k, v, documents, p, scale)
        if p > 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale)
        return kernels.flash_attention(q, k, v, causal=True, softmax_scale=scale, impl=self.impl)
