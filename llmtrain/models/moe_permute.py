"""Moving MoE rows between token order and expert order with gathers only.

Experts take the (token, slot) assignments sorted by expert: row i of that order is assignment order[i], of
token order[i] // k. Going there is a gather (index_select); coming back sums each token's k slots, which a
scatter-add (index_add_) would do, but on CPU index_add_ is not vectorised for bf16 and measured slower than
gathering each slot's rows (tokens, hidden) and accumulating them in fp32 (index_add_ would round after every
add). Each direction is the other's adjoint, so both backward passes are gathers too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertOrder:
    """Where each (token, slot) assignment sits in the expert-sorted rows."""

    order: torch.Tensor
    """(routed,) flat assignment index (token * k + slot) of each expert-sorted row."""
    slot_row: torch.Tensor
    """(tokens * k,) expert-sorted row of each assignment; `routed` (one past the last row, a zero row) for
    an assignment that was dropped."""
    top_k: int

    @classmethod
    def of(cls, order: torch.Tensor, tokens: int, top_k: int) -> ExpertOrder:
        routed = order.shape[0]
        slot_row = torch.full((tokens * top_k,), routed, dtype=torch.long, device=order.device)
        slot_row[order] = torch.arange(routed, device=order.device)
        return cls(order, slot_row, top_k)

    @property
    def dropless(self) -> bool:
        return self.order.shape[0] == self.slot_row.shape[0]


def _to_experts(x: torch.Tensor, where: ExpertOrder) -> torch.Tensor:
    return x.index_select(0, where.order // where.top_k)


def _to_tokens(rows: torch.Tensor, where: ExpertOrder, weights: torch.Tensor | None) -> torch.Tensor:
    """sum over each token's slots of (weight *) row, accumulated slot by slot in fp32 (or wider), so no
    (routed, hidden) product is ever materialised; one rounding to the rows' dtype."""
    tokens, k = where.slot_row.shape[0] // where.top_k, where.top_k
    if not where.dropless:  # dropped assignments read a zero row (and weight) appended past the last one
        rows = torch.cat((rows, rows.new_zeros(1, rows.shape[1])))
        weights = None if weights is None else torch.cat((weights, weights.new_zeros(1)))
    slot_row = where.slot_row.view(tokens, k)
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    out = torch.zeros(tokens, rows.shape[1], dtype=acc_dtype, device=rows.device)
    for j in range(k):
        part = rows.index_select(0, slot_row[:, j])
        if weights is None:
            out.add_(part)
        else:
            out.addcmul_(part, weights.index_select(0, slot_row[:, j]).unsqueeze(1))
    return out.to(rows.dtype)


class _ToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return _to_experts(x, where)

    @staticmethod
    def backward(ctx, grad):
        return _to_tokens(grad, ctx.where, None), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, where):
        ctx.where = where
        ctx.save_for_backward(rows, weights)
        return _to_tokens(rows, where, weights)

    @staticmethod
    def backward(ctx, grad):
        rows, weights = ctx.saved_tensors
        g = _to_experts(grad, ctx.where)
        # Products in the weights' fp32 (as autograd would form them for rows * fp32 weights), rounded once.
        d_rows = (g * weights.unsqueeze(1)).to(rows.dtype) if ctx.needs_input_grad[0] else None
        d_weights = None
        if ctx.needs_input_grad[1]:
            acc_dtype = torch.promote_types(rows.dtype, weights.dtype)
            d_weights = (g.to(acc_dtype) * rows).sum(dim=1).to(weights.dtype)
        return d_rows, d_weights, None


def to_experts(x: torch.Tensor, where: ExpertOrder) -> torch.Tensor:
    """(tokens, hidden) -> (routed, hidden): each kept assignment's token row, in expert order."""
    return _ToExperts.apply(x, where)


def combine(rows: torch.Tensor, weights: torch.Tensor, where: ExpertOrder) -> torch.Tensor:
    """(routed, hidden) expert-ordered rows and their (routed,) router weights -> (tokens, hidden): the
    weighted sum of each token's kept rows, products and sum in fp32 (or the wider of the two dtypes), one
    rounding to the rows' dtype, as transformers' grouped_mm experts compute it."""
    return _Combine.apply(rows, weights, where)
