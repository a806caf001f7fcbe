"""Greedy decoding with a CausalLM, token for token what transformers' `generate(do_sample=False)` gives.

No KV cache: every step runs the whole sequence again (cost quadratic in its length), which is plenty for
checking an export or sampling a small model, and keeps this independent of the attention kernels.
"""

from __future__ import annotations

import torch

from llmtrain.models.causal_lm import CausalLM


@torch.no_grad()
def greedy_generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """`input_ids` (batch, prompt) followed by up to `max_new_tokens` argmax tokens per row.

    As in transformers: a row that has produced `eos_token_id` continues with `pad_token_id` (default: the
    eos id), and generation stops early once every row has.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, prompt length); got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
    total = input_ids.shape[1] + max_new_tokens
    if model.embed_positions is not None and total > model.embed_positions.num_embeddings:
        raise ValueError(
            f"{input_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed the model's "
            f"{model.embed_positions.num_embeddings} positions; ask for fewer tokens"
        )
    pad = eos_token_id if pad_token_id is None else pad_token_id
    ids = input_ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        next_ids = model(ids)[:, -1].argmax(dim=-1)
        if eos_token_id is not None:
            next_ids = torch.where(done, torch.full_like(next_ids, pad), next_ids)
            done |= next_ids == eos_token_id
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
        if bool(done.all()):
            break
    return ids
