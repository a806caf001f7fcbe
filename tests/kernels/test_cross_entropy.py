"""Cross-entropy kernels vs torch's F.cross_entropy in float64: plain, vocab-parallel (gloo), fused linear."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, forward_backward, randn
from tests.parallel._dist import start_ranks


def _targets(shape, vocab, gen=None, ignore_every: int = 4):
    t = torch.randint(0, vocab, shape, generator=gen)
    t.view(-1)[::ignore_every] = -100  # some ignored positions
    return t


def _ce64(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,vocab", [((2, 9), 300), ((13,), 5000), ((3, 4), 4096 + 17)])
def test_cross_entropy_matches_torch(shape, vocab, dtype):
    logits = randn(*shape, vocab, dtype=dtype, scale=3.0)
    target = _targets(shape, vocab).to(DEVICE)
    got, got_g = forward_backward(lambda x: kernels.cross_entropy(x, target, impl="triton"), [logits])
    exp, exp_g = forward_backward(lambda x: _ce64(x, target), [logits.detach().double().requires_grad_()])
    assert got[0].dtype == torch.float32  # the loss is fp32 whatever the logits dtype
    assert_close(got[0], exp[0], torch.float32, what="loss")  # fp32 statistics even for fp16 logits
    assert got_g[0].dtype == dtype
    assert_close(got_g[0], exp_g[0], dtype, what="grad logits")


def test_cross_entropy_ignored_rows_get_zero_grad():
    logits = randn(6, 50, dtype=torch.float32)
    target = torch.tensor([1, -100, 3, -100, 49, 0], device=DEVICE)
    loss = kernels.cross_entropy(logits, target, impl="triton")
    loss.backward()
    assert torch.all(logits.grad[1] == 0) and torch.all(logits.grad[3] == 0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target), atol=1e-6, rtol=1e-6)


def _vocab_parallel_worker(rank: int, world: int, init_file: str):
    # CPU tensors under the interpreter on any machine: 4 NCCL ranks cannot share one GPU.
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # One 4-process job checks tp=4 (the whole world) and tp=2 (two groups {0,1}, {2,3}).
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for tp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
            vocab = 24 * tp  # each rank's shard is 24 wide
            gen = torch.Generator().manual_seed(100 + tp)  # the ranks of a group draw identical data
            full = 3 * torch.randn(2, 5, vocab, generator=gen, dtype=torch.float64)
            target = _targets((2, 5), vocab, gen, ignore_every=3)
            shard = vocab // tp
            group_rank = dist.get_rank(group)
            cols = slice(group_rank * shard, (group_rank + 1) * shard)
            for dtype in (torch.float32, torch.float16):
                full64 = (
                    full.to(dtype).double().requires_grad_()
                )  # the reference sees the same rounded logits
                exp_loss = _ce64(full64, target)
                (exp_grad,) = torch.autograd.grad(exp_loss, [full64])
                for impl in ("torch", "triton"):
                    local = full[..., cols].to(dtype).requires_grad_()
                    loss = kernels.cross_entropy(local, target, tp_group=group, impl=impl)
                    (grad,) = torch.autograd.grad(loss, [local])
                    what = f"tp={tp} {impl} {dtype} rank {rank}"
                    assert_close(loss, exp_loss, torch.float32, what=f"loss {what}")
                    assert_close(grad, exp_grad[..., cols], dtype, what=f"grad {what}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_gloo_tp2_tp4(tmp_path):
    start_ranks(_vocab_parallel_worker, (4, str(tmp_path / "store")), 4)


# (token shape, hidden, vocab, chunk_tokens, chunk_vocab): every case loops several times in both passes
# with a ragged last chunk in each (18 % 4, 300 % 64; 21 % 5, 777 % 100; the defaults give 16 tokens and
# 512 vocab rows per chunk for 17 tokens and 1000 ids).
FLCE_CASES = [((2, 9), 24, 300, 4, 64), ((3, 7), 32, 777, 5, 100), ((17,), 40, 1000, None, None)]


def _flce_reference(h, w, target):
    return forward_backward(
        lambda h, w: _ce64(h @ w.t(), target), [t.detach().double().requires_grad_() for t in (h, w)]
    )


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,vocab,chunk,chunk_vocab", FLCE_CASES)
def test_fused_linear_cross_entropy_matches_torch(tokens, hidden, vocab, chunk, chunk_vocab, dtype, impl):
    h = randn(*tokens, hidden, dtype=dtype)
    w = randn(vocab, hidden, dtype=dtype, scale=0.3)
    target = _targets(tokens, vocab).to(DEVICE)
    got, got_g = forward_backward(
        lambda h, w: kernels.fused_linear_cross_entropy(
            h, w, target, impl=impl, chunk_tokens=chunk, chunk_vocab=chunk_vocab
        ),
        [h, w],
    )
    exp, exp_g = _flce_reference(h, w, target)
    # fp16 logits are rounded once before the fp32 softmax: the loss inherits fp16-level error.
    assert_close(got[0], exp[0], dtype, what="loss")
    for name, a, e in zip(["hidden", "weight"], got_g, exp_g, strict=True):
        assert a.dtype == dtype
        # Each gradient is one matmul, over vocab (hidden) or over all tokens (weight, written once per
        # vocab chunk, no cross-chunk sum), of logit grads rounded once to `dtype`, accumulated in fp32
        # and rounded once more: two roundings of `dtype`, hence twice its tolerance.
        assert_close(a, e, dtype, scale=2.0, what=f"grad {name}")
    ignored = (target.reshape(-1) == -100).nonzero()[:, 0]
    assert torch.all(got_g[0].reshape(-1, hidden)[ignored] == 0), "ignored rows must get no gradient"


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_fused_linear_cross_entropy_one_gradient(which, impl):
    """Only one input needs a gradient: pass 2 (weight) or pass 1's gradient write (hidden) is skipped,
    and the other gradient is still exact."""
    dtype = torch.float32
    h = randn(11, 16, dtype=dtype, grad=which == "hidden")
    w = randn(90, 16, dtype=dtype, scale=0.3, grad=which == "weight")
    target = _targets((11,), 90).to(DEVICE)
    loss = kernels.fused_linear_cross_entropy(h, w, target, impl=impl, chunk_tokens=3, chunk_vocab=32)
    (got,) = torch.autograd.grad(loss, [h if which == "hidden" else w])
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    exp_loss = _ce64(h64 @ w64.t(), target)
    (exp,) = torch.autograd.grad(exp_loss, [h64 if which == "hidden" else w64])
    assert_close(loss, exp_loss, dtype, what="loss")
    assert_close(got, exp, dtype, scale=2.0, what=f"grad {which}")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_linear_cross_entropy_without_grad(impl):
    h, w = torch.randn(5, 8).to(DEVICE), torch.randn(30, 8).to(DEVICE)
    target = torch.tensor([3, -100, 29, 0, 7]).to(DEVICE)
    with torch.no_grad():
        loss = kernels.fused_linear_cross_entropy(h, w, target, impl=impl, chunk_tokens=2)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.t(), target), atol=1e-6, rtol=1e-6)


def test_fused_linear_cross_entropy_backward_twice_refused():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    loss = kernels.fused_linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4]), impl="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_cross_entropy_rejects_bad_target_shape():
    with pytest.raises(ValueError, match="target shape"):
        kernels.cross_entropy(torch.randn(4, 10), torch.zeros(5, dtype=torch.long), impl="torch")
