"""The Triton kernels inside torch.compile: gradients equal to the eager kernels' where one tensor feeds
several inputs of a kernel, and with non-contiguous and broadcast incoming gradients.

The failure these guard against (CUDA, Inductor): a user-defined Triton launch traced into the graph keeps
the strides read at trace time while Inductor functionalises its pointer arguments one by one, so with k is
v (or a gradient passed as two arguments) the compiled backward fed the kernel other memory than it indexed
(grad x off by 6.2 in fp32 on an H100). Every launch now runs as an opaque custom op under compile
(kernels._utils.compiled_as_op). On CUDA each case runs in every dtype; on CPU the same cases run through
Inductor's CPU backend with the interpreted kernels inside the ops (fp32; slow: each case compiles).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, randn

CUDA = DEVICE.type == "cuda"
# On CPU every case compiles a graph with Inductor's C++ backend (tens of seconds each on two cores).
pytestmark = [] if CUDA else [pytest.mark.slow]
CASE_DTYPES = DTYPES if CUDA else [torch.float32]


def _attention_k_is_v(x, w):
    """RMSNorm (eps a Python float) feeding causal GQA attention whose k and v are one tensor."""
    h = kernels.rms_norm(x, w, 1e-5, impl="triton")
    q = h.view(1, 64, 4, 32).transpose(1, 2)
    kv = h[..., :64].reshape(1, 64, 2, 32).transpose(1, 2)
    return kernels.flash_attention(q, kv, kv, True, 0.2, impl="triton")


def _torch_attention_k_is_v(x, w):
    """Triton RMSNorm under torch's attention with k is v (failed in bf16 on the H100 the same way)."""
    h = kernels.rms_norm(x, w, 1e-5, impl="triton")
    q = h.view(1, 64, 4, 32).transpose(1, 2)
    kv = h[..., :64].reshape(1, 64, 2, 32).transpose(1, 2).repeat_interleave(2, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)


def _attention_qkv_views(x, w):
    """q, k and v as views of one fused projection; the output leaves transposed (a non-contiguous
    incoming gradient) and is reduced by a sum (a broadcast one)."""
    qkv = (x @ w).view(1, 64, 3, 4, 32)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    o = kernels.flash_attention(q, k, v, True, None, impl="triton")
    return o.transpose(1, 2).reshape(1, 64, 128), o.sum()


def _norm_residual_is_input(x, w):
    """A residual that is also the input, with its sum output consumed twice."""
    y, h = kernels.rms_norm(x, w, 1e-5, impl="triton", residual=x)
    return y * h, h.sum()


def _layer_norm_broadcast(x, w):
    return kernels.layer_norm(x, w, w, 1e-5, impl="triton").sum()


def _rotary_shared_buffer(x, w):
    """q and k rotated from views of one buffer. The tables are computed in fp32 and rounded once, as the
    model's are: built from an input in the case's dtype, Inductor's fused (unrounded) angles and eager's
    rounded ones gave cosines a few ulps apart at angles near 64 (fp16/bf16 failed on the H200 by that)."""
    qk = (x @ w).view(1, 64, 2, 4, 32)
    inv_freq = 10000.0 ** (-torch.arange(16, device=x.device, dtype=torch.float32) / 16)
    angles = torch.arange(64, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = (t.repeat(1, 2).to(x.dtype) for t in (angles.cos(), angles.sin()))
    q = kernels.apply_rotary(qk[:, :, 0], cos, sin, impl="triton")
    k = kernels.apply_rotary(qk[:, :, 1], cos, sin, impl="triton")
    return q * k, q.sum()


def _glu_gate_is_up(x, w):
    """swiglu(h, h), and geglu of the two halves of one projection (rows strided past their width)."""
    h = x @ w
    gate, up = h.chunk(2, dim=-1)
    return kernels.swiglu(h, h, impl="triton"), kernels.geglu(gate, up, impl="triton").sum()


def _grouped_mm_shared(x, w):
    """The same rows through the grouped GEMM twice: as x, and transposed back as a weight's input."""
    offsets = torch.tensor([16, 16, 48, 64], device=x.device, dtype=torch.int32)
    rows = x.view(64, 128)
    weight = w.t().reshape(4, 96, 128)[:, :32]
    y = kernels.grouped_mm(rows, weight, offsets, impl="triton")
    return y, kernels.grouped_mm(rows, weight, offsets, impl="triton").t()


def _cross_entropy_of_projection(x, w):
    logits = (x @ w).view(64, 384)
    target = (torch.arange(64, device=x.device) * 7) % 384
    return kernels.cross_entropy(logits, target, impl="triton") * 2.0


# (function, weight shape): each builds on x (1, 64, 128) and one weight.
CASES = {
    "attention-k-is-v": (_attention_k_is_v, (128,)),
    "torch-attention-k-is-v": (_torch_attention_k_is_v, (128,)),
    "attention-qkv-views": (_attention_qkv_views, (128, 384)),
    "rms-norm-residual-is-input": (_norm_residual_is_input, (128,)),
    "layer-norm-broadcast-grad": (_layer_norm_broadcast, (128,)),
    "rotary-shared-buffer": (_rotary_shared_buffer, (128, 256)),
    "glu-gate-is-up": (_glu_gate_is_up, (128, 256)),
    "grouped-mm-shared-rows": (_grouped_mm_shared, (128, 384)),
    "cross-entropy": (_cross_entropy_of_projection, (128, 384)),
}


def _grads(fn, x, w):
    """Outputs of fn(x, w) and d<outputs, fixed cotangents>/d(x, w); scalar outputs get cotangent 1 (the
    broadcast gradient of a sum or a mean)."""
    outs = fn(x, w)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    total = 0
    for o in outs:
        cot = torch.randn(o.shape, generator=gen, dtype=torch.float64).half().to(o.device, o.dtype)
        total = total + (o * cot).sum()
    return outs, torch.autograd.grad(total, (x, w))


@pytest.mark.parametrize("dtype", CASE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_gradients_equal_eager(case, dtype):
    """The eager kernels are checked against float64 elsewhere; compiled, the same kernels run (opaque to
    Inductor), so outputs and gradients agree to the dtype's tolerance (the surrounding torch ops may be
    fused and reordered by Inductor, a few roundings of the dtype)."""
    fn, w_shape = CASES[case]
    torch._dynamo.reset()
    x = randn(1, 64, 128, dtype=dtype, scale=0.5)
    w = randn(*w_shape, dtype=dtype, scale=w_shape[0] ** -0.5 if len(w_shape) == 2 else 1.0)
    got, got_g = _grads(torch.compile(fn, dynamic=False, fullgraph=True), x, w)
    exp, exp_g = _grads(fn, x, w)
    for i, (a, e) in enumerate(zip(got, exp, strict=True)):
        assert a.dtype == e.dtype
        assert_close(a, e, dtype, scale=4.0, what=f"{case} output {i}")
    for name, a, e in zip(("x", "w"), got_g, exp_g, strict=True):
        assert_close(a, e, dtype, scale=4.0, what=f"{case} grad {name}")
