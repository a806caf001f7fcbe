"""Kernel tests run the Triton kernels compiled on CUDA when a GPU is present, else on CPU tensors through
the Triton interpreter: every test builds its tensors on DEVICE.

TRITON_INTERPRET=1 is read when a @triton.jit function is defined, i.e. when a kernels.<module> holding
kernels is first imported; tests/conftest.py sets it for the whole session on machines without CUDA.
Outside pytest run with `TRITON_INTERPRET=1 python ...`.

Every test compares against the PyTorch reference in kernels/reference.py (torch's own ops: F.layer_norm,
F.scaled_dot_product_attention, F.cross_entropy, ...) evaluated in float64 on the same (rounded) inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Tolerances against the float64 reference, per input dtype. fp32 kernels accumulate in fp32, so errors
# stay within a few ulps of the O(1) values; fp16 / bf16 outputs are rounded once to their dtype (ulp
# 2^-10 / 2^-7 relative), so tolerances sit at about two ulps of that dtype. Compiled on CUDA, fp16/bf16
# tensor-core products are exact and accumulate in fp32; flash attention also rounds P and dS to the input
# dtype before their second GEMM (half an ulp per element, independent errors averaged over the keys),
# which stays inside those two ulps.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# bf16 arithmetic (tl.dot included) is wrong under the interpreter, so there every kernel casts its tiles to
# fp32 right after loading (UPCAST): interpreted bf16 cases test that cast, not bf16 compute. Only compiled
# on CUDA do the tensor cores multiply bf16, and there the whole grid runs in bf16 too.
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        INTERPRETED,
        reason="interpreted kernels upcast bf16 to fp32 (tl.dot on bf16 is wrong in the interpreter); "
        "test_bf16.py keeps one interpreted case per kernel, the full grid runs compiled on CUDA",
    ),
    id="bfloat16",
)
DTYPES = [torch.float32, torch.float16, BF16]


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    """Normal values drawn in float64 on the CPU (the same numbers on every device), rounded to `dtype` on
    DEVICE; a leaf requiring grad unless `grad` is False."""
    x = (scale * torch.randn(*shape, dtype=torch.float64)).to(DEVICE, dtype)
    return x.requires_grad_(grad)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0, what: str = ""
):
    """Check against float64 with the tolerance of `dtype`, widened by `scale` where a test says why."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=tol["atol"] * scale,
        rtol=tol["rtol"] * scale,
        msg=lambda m: f"{what}: {m}",
    )


def forward_backward(fn, inputs, cotangent_seed: int = 1):
    """Outputs of fn(*inputs) and the gradients of <outputs, random cotangents> w.r.t. inputs needing grad.

    The cotangents come from a fixed seed and are rounded through fp16, so a kernel run (any dtype) and its
    float64 reference run receive exactly the same upstream gradients.
    """
    outs = fn(*inputs)
    outs_t = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(cotangent_seed)
    total = 0
    for o in outs_t:
        cot = torch.randn(o.shape, generator=gen, dtype=torch.float64).half().to(o.device, o.dtype)
        total = total + (o * cot).sum()
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(total, leaves)
    return outs_t, grads


def as_float64_leaves(*tensors):
    """float64 copies of the inputs, keeping requires_grad where the original had it."""
    return [
        t.detach().double().requires_grad_(t.requires_grad)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
        else t
        for t in tensors
    ]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
