"""Token order <-> expert order for the MoE experts, against index_select / index_add_ written out here."""

from __future__ import annotations

import pytest
import torch

from llmtrain.models.moe_permute import ExpertOrder, combine, to_experts


def _routing(tokens: int, k: int, experts: int, drop: bool) -> torch.Tensor:
    slots = torch.randint(0, experts, (tokens * k,))
    if drop:  # dropped assignments sort past the last expert and are cut off, as Experts.forward does
        slots[::3] = experts
    order = slots.argsort(stable=True)
    return order[: int((slots < experts).sum())]


@pytest.mark.parametrize("drop", [False, True])
def test_matches_index_select_and_index_add(drop):
    torch.manual_seed(0)
    tokens, k, h = 11, 3, 5
    order = _routing(tokens, k, 4, drop)
    where = ExpertOrder.of(order, tokens, k)
    assert where.dropless == (not drop)
    x = torch.randn(tokens, h, dtype=torch.float64)
    torch.testing.assert_close(to_experts(x, where), x[order // k], rtol=0, atol=0)
    y = torch.randn(order.shape[0], h, dtype=torch.float64)
    w = torch.rand(tokens, k, dtype=torch.float64)  # token order, as the router gives them
    expected = torch.zeros_like(x).index_add_(0, order // k, y * w.flatten()[order, None])
    torch.testing.assert_close(combine(y, w, where), expected)


@pytest.mark.parametrize("drop", [False, True])
def test_gradients_float64(drop):
    torch.manual_seed(1)
    tokens, k = 7, 2
    where = ExpertOrder.of(_routing(tokens, k, 3, drop), tokens, k)
    routed = where.order.shape[0]
    x = torch.randn(tokens, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(routed, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(tokens, k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: to_experts(x, where), (x,))
    assert torch.autograd.gradcheck(lambda y, w: combine(y, w, where), (y, w))
    # Second order too: the tests' one-process reference takes Hessian-vector products through the block.
    assert torch.autograd.gradgradcheck(lambda x: to_experts(x, where), (x,))
    assert torch.autograd.gradgradcheck(lambda y, w: combine(y, w, where), (y, w))


def test_bf16_rows_are_weighted_and_summed_in_fp32():
    # 256 + 1 + 1 in bf16 (8 significant bits) rounds to 256 when each add rounds, as index_add_ does;
    # summed in fp32 and rounded once it is 258. The fp32 weight 1/3 is applied before any rounding too.
    where = ExpertOrder.of(torch.tensor([0, 1, 2]), 1, 3)
    rows = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    assert combine(rows, torch.ones(1, 3), where).item() == 258.0
    third = torch.full((1, 3), 1 / 3)
    assert combine(rows * 3, third, where).item() == torch.tensor(258.0).to(torch.bfloat16).item()


@pytest.mark.parametrize("drop", [False, True])
def test_bf16_gradients_match_float64(drop):
    # bf16 rows with fp32 weights take the slot-by-slot backward (products in fp32, d_rows rounded once);
    # same-dtype operands (the gradchecks above) take the in-place one.
    torch.manual_seed(2)
    tokens, k, h = 9, 3, 16
    where = ExpertOrder.of(_routing(tokens, k, 4, drop), tokens, k)
    y = torch.randn(where.order.shape[0], h).to(torch.bfloat16).requires_grad_()
    w = torch.rand(tokens, k, requires_grad=True)
    g = torch.randn(tokens, h).to(torch.bfloat16)
    combine(y, w, where).backward(g)
    y64, w64 = (t.detach().double().requires_grad_() for t in (y, w))
    expected = torch.zeros(tokens, h, dtype=torch.float64).index_add(
        0, where.order // k, y64 * w64.flatten()[where.order, None]
    )
    expected.backward(g.double())
    # d_rows: one fp32 product per element rounded once to bf16 (relative 2^-8); d_weights: exact products
    # of bf16 values summed over h=16 terms in fp32.
    torch.testing.assert_close(y.grad.double(), y64.grad, rtol=2**-8, atol=0)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)
