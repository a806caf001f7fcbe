"""One bf16 case per kernel vs the float64 PyTorch reference (torch's own ops), at bf16 tolerance.

Guards the interpreter pitfall the kernels design around: bf16 values must be cast to fp32 right after
loading, or the arithmetic is silently wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels import reference
from tests.kernels.conftest import DEVICE, as_float64_leaves, assert_close, forward_backward, randn

BF16 = torch.bfloat16


def _check(run, ref, inputs, grad_scale: float = 1.0):
    got, got_g = forward_backward(run, inputs)
    exp, exp_g = forward_backward(ref, as_float64_leaves(*inputs))
    for a, e in zip(got, exp, strict=True):
        assert_close(a, e, BF16 if a.dtype == BF16 else torch.float32, what="output")
    for a, e in zip(got_g, exp_g, strict=True):
        assert a.dtype == BF16
        assert_close(a, e, BF16, scale=grad_scale, what="grad")


def _rand(*shape, scale=1.0):
    return randn(*shape, dtype=BF16, scale=scale)


def test_norms_bf16():
    x, w, b, r = _rand(3, 5, 72), _rand(72, scale=0.5), _rand(72, scale=0.5), _rand(3, 5, 72)
    _check(
        lambda x, w, r: kernels.rms_norm(x, w, 1e-6, "triton", residual=r),
        lambda x, w, r: (reference.rms_norm(x + r, w, 1e-6), x + r),
        [x, w, r],
        grad_scale=2.0,  # the weight gradient sums 15 rows of rounded products
    )
    _check(
        lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5, "triton"),
        lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        [x, w, b],
        grad_scale=2.0,
    )


def test_rotary_bf16():
    a = torch.outer(torch.arange(9.0, dtype=torch.float64), 1e4 ** (-torch.arange(0, 32, 2) / 32))
    emb = a.repeat_interleave(2, -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    x = _rand(2, 6, 3, 32)
    _check(
        lambda x: kernels.apply_rotary(x, cos.float(), sin.float(), True, "triton", position_offset=3),
        lambda x: reference.apply_rotary(x, cos[3:], sin[3:], True).double(),
        [x],
    )


def test_glu_bf16():
    g, u = _rand(4, 50, scale=2.0), _rand(4, 50)
    _check(lambda g, u: kernels.swiglu(g, u, "triton"), lambda g, u: F.silu(g) * u, [g, u])
    _check(lambda g, u: kernels.geglu(g, u, "triton"), lambda g, u: F.gelu(g, approximate="tanh") * u, [g, u])


def test_flash_attention_bf16():
    q, k, v = _rand(1, 4, 29, 32), _rand(1, 2, 29, 32), _rand(1, 2, 29, 32)
    _check(
        lambda q, k, v: kernels.flash_attention(q, k, v, impl="triton"),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        [q, k, v],
        grad_scale=2.0,
    )


def test_cross_entropy_bf16():
    logits = _rand(11, 777, scale=3.0)
    target = torch.randint(0, 777, (11,)).to(DEVICE)
    target[4] = -100
    _check(
        lambda x: kernels.cross_entropy(x, target, impl="triton"),
        lambda x: F.cross_entropy(x, target),
        [logits],
    )


def test_grouped_mm_bf16():
    offsets = torch.tensor([5, 5, 21], device=DEVICE).to(torch.int32)  # an empty group in the middle
    x, w = _rand(21, 40), _rand(3, 24, 40, scale=40**-0.5)
    _check(
        lambda x, w: kernels.grouped_mm(x, w, offsets, impl="triton"),
        lambda x, w: reference.grouped_mm(x, w, offsets),
        [x, w],
        grad_scale=2.0,  # dW sums 16 rows of products, dX 24 columns, in fp32 before one bf16 rounding
    )
