"""The Triton kernels inside torch.compile (Inductor), as bench_e2e's compiled blocks run them.

Inductor launches user-defined Triton kernels itself and passes Python floats (the softmax scale, a norm's
eps) as fp64 scalars; the first H100 run failed there ("loop-carried variable m_i ... fp64"). Inductor
compiles user-defined Triton kernels for GPUs only, so these tests run where CUDA is.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, forward_backward, randn

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda", reason="Inductor compiles user-defined Triton kernels for GPUs only"
)


def _norm_then_attention(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm (eps a Python float) feeding causal GQA attention with a custom scale."""
    h = kernels.rms_norm(x, weight, 1e-5, impl="triton")
    q = h.view(1, 64, 4, 32).transpose(1, 2)
    kv = h[..., :64].reshape(1, 64, 2, 32).transpose(1, 2)
    return kernels.flash_attention(q, kv, kv, True, 0.2, impl="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernels_equal_eager_kernels(dtype):
    """The eager kernels are checked against float64 elsewhere; compiled, the same kernels run, so only the
    tile sizes autotuning picks (fp32 accumulation order) may differ: the dtype's tolerance holds."""
    x = randn(1, 64, 128, dtype=dtype)
    weight = randn(128, dtype=dtype)
    compiled = torch.compile(_norm_then_attention, dynamic=False)
    got, got_g = forward_backward(compiled, [x, weight])
    exp, exp_g = forward_backward(_norm_then_attention, [x, weight])
    assert got[0].dtype == dtype
    assert_close(got[0], exp[0], dtype, what="output")
    for name, a, e in zip(("x", "weight"), got_g, exp_g, strict=True):
        assert_close(a, e, dtype, what=f"grad {name}")
