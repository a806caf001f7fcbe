"""Grouped GEMM (Triton kernel and PyTorch path) and the SwiGLU experts built on it, against float64
references: one F.linear per group (kernels.reference.grouped_mm) and a per-expert loop written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import grouped_torch, reference
from tests.kernels.conftest import DEVICE, as_float64_leaves, assert_close, forward_backward, randn

# Group sizes covering the edges: empty groups (first, middle, last), a one-row group, groups that end
# inside a 16-row tile, one crossing several tiles; an odd number of groups.
COUNTS = [0, 1, 5, 0, 19, 3, 0]


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, device=DEVICE).cumsum(0, dtype=torch.int32)


def _check(run, ref, inputs, dtype, grad_scale=1.0):
    got, got_g = forward_backward(run, inputs)
    exp, exp_g = forward_backward(ref, as_float64_leaves(*inputs))
    assert got[0].dtype == dtype
    assert_close(got[0], exp[0], dtype, what="output")
    for a, e in zip(got_g, exp_g, strict=True):
        assert a.dtype == dtype
        assert_close(a, e, dtype, scale=grad_scale, what="grad")


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(24, 41), (16, 32)])
def test_grouped_mm_matches_per_group_linear(impl, dtype, n, k):
    # (24, 41): N and K not multiples of the 16-wide tiles, and x's rows not 16-byte aligned, so the torch
    # path runs its per-group fallback; (16, 32): aligned, so it runs F.grouped_mm.
    assert grouped_torch.library_takes(torch.empty(1, k, dtype=dtype)) == (k == 32)
    offsets = _offsets(COUNTS)
    x = randn(sum(COUNTS), k, dtype=dtype)
    w = randn(len(COUNTS), n, k, dtype=dtype, scale=k**-0.5)
    _check(
        lambda x, w: kernels.grouped_mm(x, w, offsets, impl=impl),
        lambda x, w: reference.grouped_mm(x, w, offsets),
        [x, w],
        dtype,
        # dW sums up to 19 rows of rounded products, dX up to 24 columns: a few more roundings than the
        # forward's single K-sum, all accumulated in fp32 before the one rounding to dtype.
        grad_scale=2.0,
    )


def test_torch_grouped_mm_gradcheck_float64():
    # float64 runs the per-group loop (F.grouped_mm takes no float64); gradcheck differentiates it
    # numerically, so it also checks the Function's backward formulas.
    offsets = _offsets([2, 0, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: kernels.grouped_mm(x, w, offsets, impl="torch"), (x, w))


def test_torch_moe_experts_gradcheck_float64():
    # Checks the experts Function's hand-written backward (gradients written into its own buffers, silu
    # recomputed).
    c = torch.tensor([2, 0, 1])
    rows = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda r, gu, d: kernels.moe_experts(r, c, gu, d, impl="torch")
    assert torch.autograd.gradcheck(fn, (rows, gate_up, down))
    # Second order too: the tests' one-process reference takes Hessian-vector products through the experts.
    assert torch.autograd.gradgradcheck(fn, (rows, gate_up, down))


def test_torch_moe_experts_backward_runs_twice():
    # The backward overwrites its own buffers with gradients; a second backward (retain_graph) recomputes
    # them, so it gives the first one's gradients exactly.
    c = torch.tensor([5, 0, 3])
    rows = randn(8, 32, dtype=torch.float32)
    gate_up = randn(3, 48, 32, dtype=torch.float32, scale=32**-0.5)
    down = randn(3, 32, 24, dtype=torch.float32, scale=24**-0.5)
    out = kernels.moe_experts(rows, c, gate_up, down, impl="torch")
    dy = torch.randn_like(out)
    first = torch.autograd.grad(out, (rows, gate_up, down), dy, retain_graph=True)
    second = torch.autograd.grad(out, (rows, gate_up, down), dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_backward_takes_a_zero_stride_gradient(impl):
    # `.sum()` hands back an expanded (zero-stride) gradient, which torch._grouped_mm's backward rejects.
    offsets = _offsets([16, 0, 16])
    x = randn(32, 16, dtype=torch.float32)
    w = randn(3, 16, 16, dtype=torch.float32)
    kernels.grouped_mm(x, w, offsets, impl=impl).sum().backward()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    reference.grouped_mm(xd, wd, offsets).sum().backward()
    assert_close(x.grad, xd.grad, torch.float32)
    assert_close(w.grad, wd.grad, torch.float32)
    assert torch.count_nonzero(w.grad[1]) == 0


def _experts_loop(rows, counts, gate_up, down):
    out = []
    for e, r in enumerate(rows.split(counts)):
        gate, up = F.linear(r, gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_moe_experts_matches_per_expert_loop(impl):
    counts = [3, 0, 17, 1, 0]
    h, f = 32, 24
    rows = randn(sum(counts), h, dtype=torch.float32)
    gate_up = randn(len(counts), 2 * f, h, dtype=torch.float32, scale=h**-0.5)
    down = randn(len(counts), h, f, dtype=torch.float32, scale=f**-0.5)
    c = torch.tensor(counts, device=DEVICE)
    _check(
        lambda r, gu, d: kernels.moe_experts(r, c, gu, d, impl=impl),
        lambda r, gu, d: _experts_loop(r, counts, gu, d),
        [rows, gate_up, down],
        torch.float32,
        grad_scale=2.0,  # as above: the gradients chain two products, each summed in fp32
    )


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_moe_experts_takes_host_counts_and_no_rows(impl):
    # Expert parallelism hands over counts as ints, and a rank may receive no row at all.
    gate_up = randn(3, 32, 16, dtype=torch.float32)
    down = randn(3, 16, 16, dtype=torch.float32)
    rows = randn(0, 16, dtype=torch.float32)
    out = kernels.moe_experts(rows, [0, 0, 0], gate_up, down, impl=impl)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.count_nonzero(gate_up.grad) == 0 and torch.count_nonzero(down.grad) == 0


def test_bf16_torch_path_matches_float64():
    # bf16 is the CPU fast path of F.grouped_mm (the Triton kernel is not run in bf16 under the interpreter,
    # where tl.dot on bf16 is wrong); one bf16 rounding of outputs summed in fp32.
    offsets = _offsets([8, 0, 24, 1])
    x = randn(33, 64, dtype=torch.bfloat16)
    w = randn(4, 32, 64, dtype=torch.bfloat16, scale=0.125)
    _check(
        lambda x, w: kernels.grouped_mm(x, w, offsets, impl="torch"),
        lambda x, w: reference.grouped_mm(x, w, offsets),
        [x, w],
        torch.bfloat16,
        grad_scale=2.0,
    )


def test_rejects_bad_offsets():
    x, w = torch.randn(4, 8), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="offsets must be int32"):
        kernels.grouped_mm(x, w, torch.tensor([2, 4]), impl="torch")
    with pytest.raises(ValueError, match="agree on K"):
        kernels.grouped_mm(x, torch.randn(2, 3, 5), torch.tensor([2, 4], dtype=torch.int32), impl="torch")
