"""RMSNorm / LayerNorm Triton kernels vs the float64 PyTorch reference (HF-style RMSNorm, F.layer_norm)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.conftest import DEVICE, DTYPES, as_float64_leaves, assert_close, forward_backward, randn

SHAPES = [(2, 5, 64), (3, 7, 48), (1, 13, 200), (37, 1000)]  # ragged hidden sizes and row counts


def _inputs(shape, dtype, residual: bool, bias: bool = True):
    n = shape[-1]
    x = randn(*shape, dtype=dtype)
    w = (1 + 0.5 * torch.randn(n, dtype=torch.float64)).to(DEVICE, dtype).requires_grad_()
    b = randn(n, dtype=dtype, scale=0.5) if bias else None
    r = randn(*shape, dtype=dtype) if residual else None
    return x, w, b, r


def _ref_with_residual(norm):
    def run(x, w, b, r):
        h = x + r if r is not None else x
        out = norm(h, w, b)
        return (out, h) if r is not None else out

    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(shape, dtype, residual):
    x, w, _, r = _inputs(shape, dtype, residual)
    eps = 1e-6
    got, got_g = forward_backward(
        lambda x, w, r: kernels.rms_norm(x, w, eps, "triton", residual=r), [x, w, r]
    )
    ref = _ref_with_residual(lambda h, w, b: reference.rms_norm(h, w, eps))
    exp, exp_g = forward_backward(lambda x, w, r: ref(x, w, None, r), as_float64_leaves(x, w, r))
    for a, e in zip(got, exp, strict=True):
        assert a.dtype == dtype
        assert_close(a, e, dtype, what="output")
    # The weight gradient sums over every row; its error grows with the row count (sqrt-like).
    for name, a, e in zip(["x", "weight", "residual"][: len(got_g)], got_g, exp_g, strict=True):
        assert_close(a, e, dtype, scale=4.0 if name == "weight" else 1.0, what=f"grad {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual,bias", [(False, True), (True, True), (False, False)])
def test_layer_norm_matches_reference(shape, dtype, residual, bias):
    x, w, b, r = _inputs(shape, dtype, residual, bias)
    eps = 1e-5
    got, got_g = forward_backward(
        lambda x, w, b, r: kernels.layer_norm(x, w, b, eps, "triton", residual=r), [x, w, b, r]
    )
    ref = _ref_with_residual(lambda h, w, b: reference.layer_norm(h, w, b, eps))
    exp, exp_g = forward_backward(ref, as_float64_leaves(x, w, b, r))
    for a, e in zip(got, exp, strict=True):
        assert_close(a, e, dtype, what="output")
    for a, e in zip(got_g, exp_g, strict=True):
        assert_close(a, e, dtype, scale=4.0, what="grad")


def test_rms_norm_torch_impl_keeps_call_form():
    x, w, _, r = _inputs((2, 3, 16), torch.float32, residual=True)
    out = kernels.rms_norm(x, w, 1e-6, "torch")
    fused, h = kernels.rms_norm(x, w, 1e-6, "torch", residual=r)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(fused, reference.rms_norm(x + r, w, 1e-6))


def test_norm_rejects_mismatched_weight():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        kernels.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6, "triton")
