"""SwiGLU / GeGLU Triton kernels vs torch's F.silu / F.gelu(approximate="tanh") in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, forward_backward, randn

REFERENCES = {
    "swiglu": lambda g, u: F.silu(g) * u,
    "geglu": lambda g, u: F.gelu(g, approximate="tanh") * u,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", [(2, 5, 64), (3, 37), (1, 7, 1500)])
@pytest.mark.parametrize("fused_projection", [False, True])
def test_glu_matches_torch(name, shape, dtype, fused_projection):
    n = shape[-1]
    if fused_projection:
        # gate and up as the two column halves of one gate_up projection output (strided views).
        gu = randn(*shape[:-1], 2 * n, dtype=dtype, scale=2.0)
        run = lambda gu: getattr(kernels, name)(*gu.chunk(2, -1), impl="triton")
        ref = lambda gu: REFERENCES[name](*gu.chunk(2, -1))
        inputs = [gu]
    else:
        g = randn(*shape, dtype=dtype, scale=2.0)
        u = randn(*shape, dtype=dtype)
        run = lambda g, u: getattr(kernels, name)(g, u, impl="triton")
        ref = REFERENCES[name]
        inputs = [g, u]
    got, got_g = forward_backward(run, inputs)
    exp, exp_g = forward_backward(ref, [t.detach().double().requires_grad_() for t in inputs])
    assert got[0].dtype == dtype
    assert_close(got[0], exp[0], dtype, what="output")
    for a, e in zip(got_g, exp_g, strict=True):
        assert_close(a, e, dtype, what="grad")


def test_glu_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        kernels.swiglu(torch.randn(2, 4, device=DEVICE), torch.randn(2, 5, device=DEVICE), impl="triton")
