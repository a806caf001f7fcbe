"""Moving MoE rows between token order and expert order.

Experts take the (token, slot) assignments sorted by expert: row i of that order is assignment order[i], of
token order[i] // k. Going there is a gather (index_select); coming back sums each token's k slots. Where
the rows are already in the accumulation dtype (fp32) an unweighted sum is one scatter-add (index_add_, ~3x
faster on CPU than the slot loop). Otherwise (bf16 rows) each slot's rows (tokens, hidden) are gathered and
accumulated in fp32, rounded once: index_add_ would round after every add. Each direction is the other's
adjoint, so the backward passes are the same operations.
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


def _padded(where: ExpertOrder, rows: torch.Tensor) -> torch.Tensor:
    """`rows` with a zero row appended when assignments were dropped (their slot_row points there)."""
    return rows if where.dropless else torch.cat((rows, rows.new_zeros(1, *rows.shape[1:])))


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _to_tokens(rows: torch.Tensor, where: ExpertOrder, weights: torch.Tensor | None) -> torch.Tensor:
    """sum over each token's slots of (weight *) row, accumulated slot by slot in fp32 (or wider), so no
    (routed, hidden) product is ever materialised; one rounding to the rows' dtype. `weights` (tokens, k)
    are in token order, so slot j's are a column, not a gather. Operands are cast to the accumulation
    dtype first: mixed-dtype elementwise ops are not vectorised on CPU."""
    tokens, k = where.slot_row.shape[0] // where.top_k, where.top_k
    acc = _acc_dtype(rows) if weights is None else _acc_dtype(rows, weights)
    if weights is None and rows.dtype == acc:
        # Nothing to round: one scatter-add in row order (index_add_ rounds after every add, so it serves
        # only where the rows are already in the accumulation dtype); ~3x faster than the slot loop.
        out = rows.new_zeros(tokens, rows.shape[1])
        return out.index_add_(0, where.order // k, rows)
    rows = _padded(where, rows)
    out = None
    for j, idx in enumerate(where.slot_row.view(tokens, k).unbind(1)):
        part = rows.index_select(0, idx).to(acc)  # a fresh tensor either way: the first slot starts the sum
        if weights is not None:
            part.mul_(weights[:, j : j + 1].to(acc))
        out = part if out is None else out.add_(part)
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
        where = ctx.where
        acc = _acc_dtype(rows, weights)
        if rows.dtype == acc and grad.dtype == acc:
            return (*_combine_grads_in_place(rows, weights, grad, where), None)
        # Slot by slot over (tokens, hidden) slices in the accumulation dtype, as the forward: the products
        # are formed in fp32 (as autograd would for rows * fp32 weights) and d_rows is rounded once.
        routed, (tokens, k) = rows.shape[0], weights.shape
        g = grad.to(acc)
        rows = _padded(where, rows)
        d_rows, d_weights = torch.empty_like(rows), torch.empty(tokens, k, dtype=acc, device=rows.device)
        for j, idx in enumerate(where.slot_row.view(tokens, k).unbind(1)):
            d_rows.index_copy_(0, idx, (g * weights[:, j : j + 1].to(acc)).to(rows.dtype))
            d_weights[:, j] = torch.linalg.vecdot(rows.index_select(0, idx).to(acc), g)
        return d_rows[:routed], d_weights.to(weights.dtype), None


def _combine_grads_in_place(
    rows: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor, where: ExpertOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine's gradients when rows, weights and grad share one dtype (no rounding to place): the token
    gradient of every row gathered once in expert order, the weight gradients its dot products with the
    rows, then scaled in place into d_rows; sequential passes, where the slot loop scatters into d_rows."""
    d_rows = grad.index_select(0, where.order // where.top_k)
    # Row blocks of one slot's size: vecdot materialises its product, which for all rows at once would be
    # a fresh mapping (page faults) rather than reused heap memory.
    blocks = zip(rows.split(grad.shape[0]), d_rows.split(grad.shape[0]), strict=True)
    d_sorted = torch.cat([torch.linalg.vecdot(a, b) for a, b in blocks])
    scale = weights.flatten().index_select(0, where.order).unsqueeze(1)
    # Under create_graph (a Hessian-vector product) the gradient must stay differentiable: out of place.
    d_rows = d_rows * scale if torch.is_grad_enabled() else d_rows.mul_(scale)
    d_weights = d_sorted.new_zeros(weights.numel()).index_copy_(0, where.order, d_sorted)
    return d_rows, d_weights.view_as(weights)


def to_experts(x: torch.Tensor, where: ExpertOrder) -> torch.Tensor:
    """(tokens, hidden) -> (routed, hidden): each kept assignment's token row, in expert order."""
    return _ToExperts.apply(x, where)


def combine(rows: torch.Tensor, weights: torch.Tensor, where: ExpertOrder) -> torch.Tensor:
    """(routed, hidden) expert-ordered rows and the (tokens, k) router weights in token order -> (tokens,
    hidden): the weighted sum of each token's kept rows (a dropped assignment's weight gets gradient 0),
    products and sum in fp32 (or the wider of the two dtypes), one rounding to the rows' dtype, as
    transformers' grouped_mm experts compute it."""
    return _Combine.apply(rows, weights, where)
