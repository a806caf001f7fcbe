"""Packed documents (data.reset_attention_mask): which document each token of a packed sequence belongs to,
its position inside that document, and causal attention that stays inside documents.

An end-of-document token ends its document: it belongs to the document before it, and the next token starts
a new one at position 0 (Megatron's reset_attention_mask and reset_position_ids).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(input_ids: torch.Tensor, separator: int) -> torch.Tensor:
    """(b, s) index of each token's document within its sequence: the separators before it."""
    ends = (input_ids == separator).long()
    return ends.cumsum(-1) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(b, s) position of each token inside its document (0 at each document's first token)."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def same_document(q_documents: torch.Tensor, k_documents: torch.Tensor) -> torch.Tensor:
    """(b, n, m) whether query i and key j lie in the same document."""
    return q_documents[:, :, None] == k_documents[:, None, :]


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention inside documents: q (b, heads, s, d), k/v (b, kv_heads, s, d), documents (b, s);
    `scale` multiplies the scores (None: 1/sqrt(d))."""
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    mask = (same_document(documents, documents) & causal)[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
