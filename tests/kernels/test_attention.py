"""Flash-attention Triton kernel vs torch's scaled_dot_product_attention (math backend) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

import kernels
from kernels import attention
from llmtrain.models.documents import same_document
from tests.kernels.conftest import DEVICE, DTYPES, INTERPRETED, assert_close, forward_backward, randn


def _sdpa64(q, k, v, causal, scale, documents=None):
    # Repeat kv heads explicitly so the reference does not depend on SDPA's enable_gqa path. Packed
    # `documents` (b, seq) ids: causal attention inside each document, by an explicit boolean mask.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    seq = q.shape[2]
    mask = same_document(documents, documents) & torch.ones(seq, seq, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None].to(q.device), scale=scale)


CASES = [
    # batch, q_heads, kv_heads, seq, head_dim
    (1, 2, 2, 16, 16),  # one block, MHA
    (2, 4, 2, 37, 32),  # GQA, ragged tail
    (1, 3, 1, 70, 64),  # MQA, head_dim 64, several key blocks
    (1, 2, 1, 19, 128),  # head_dim 128
    (1, 2, 2, 23, 40),  # non-power-of-two head_dim
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch,hq,hkv,seq,dim", CASES)
def test_flash_attention_matches_sdpa(batch, hq, hkv, seq, dim, causal, dtype):
    q = randn(batch, hq, seq, dim, dtype=dtype)
    k = randn(batch, hkv, seq, dim, dtype=dtype)
    v = randn(batch, hkv, seq, dim, dtype=dtype)
    scale = dim**-0.5
    got, got_g = forward_backward(
        lambda q, k, v: kernels.flash_attention(q, k, v, causal=causal, impl="triton"), [q, k, v]
    )
    exp, exp_g = forward_backward(
        lambda q, k, v: _sdpa64(q, k, v, causal, scale),
        [t.detach().double().requires_grad_() for t in (q, k, v)],
    )
    assert got[0].dtype == dtype
    assert_close(got[0], exp[0], dtype, what="output")
    # Gradients sum products over the sequence (and over a GQA group for dk/dv): allow 2x.
    for name, a, e in zip("qkv", got_g, exp_g, strict=True):
        assert_close(a, e, dtype, scale=2.0, what=f"grad {name}")


def test_flash_attention_custom_scale_and_noncontiguous():
    # q/k/v as transposed views of (batch, seq, heads, dim) projections, as the model builds them.
    q = randn(1, 21, 4, 16, dtype=torch.float32, grad=False).transpose(1, 2).requires_grad_()
    k = randn(1, 21, 2, 16, dtype=torch.float32, grad=False).transpose(1, 2).requires_grad_()
    v = randn(1, 21, 2, 16, dtype=torch.float32, grad=False).transpose(1, 2).requires_grad_()
    got, got_g = forward_backward(
        lambda q, k, v: kernels.flash_attention(q, k, v, True, 0.3, impl="triton"), [q, k, v]
    )
    exp, exp_g = forward_backward(
        lambda q, k, v: _sdpa64(q, k, v, True, 0.3), [t.detach().double().requires_grad_() for t in (q, k, v)]
    )
    assert_close(got[0], exp[0], torch.float32)
    for a, e in zip(got_g, exp_g, strict=True):
        assert_close(a, e, torch.float32, scale=2.0)


def test_flash_attention_rejects_bad_gqa():
    q, k = torch.randn(1, 3, 8, 16, device=DEVICE), torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kernels.flash_attention(q, k, k, impl="torch")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk", [(9, 40), (40, 9)])
def test_flash_attention_different_query_and_key_lengths(sq, sk, causal):
    # Causal masking is top-left aligned (key j visible to query i when j <= i), as SDPA's is_causal.
    q = randn(1, 4, sq, 16, dtype=torch.float32)
    k = randn(1, 2, sk, 16, dtype=torch.float32)
    v = randn(1, 2, sk, 16, dtype=torch.float32)
    got, got_g = forward_backward(
        lambda q, k, v: kernels.flash_attention(q, k, v, causal, impl="triton"), [q, k, v]
    )
    exp, exp_g = forward_backward(
        lambda q, k, v: _sdpa64(q, k, v, causal, 0.25),
        [t.detach().double().requires_grad_() for t in (q, k, v)],
    )
    assert_close(got[0], exp[0], torch.float32)
    for a, e in zip(got_g, exp_g, strict=True):
        assert_close(a, e, torch.float32, scale=2.0)


def _one_config(kernel, config):
    return lambda device: triton.autotune(configs=[config], key=attention._KEY)(kernel)


def _distinct(configs):
    """The configs that compute differently where the test runs. Interpreted, a config is its block shape
    only: the interpreter runs a program's block as whole-array numpy ops, so num_warps and num_stages
    (threads per program, software pipelining) change nothing; of configs sharing a (BLOCK_M, BLOCK_N),
    the first stands for them all. Compiled, every config is its own code."""
    if not INTERPRETED:
        return configs
    shapes = {}
    for config in configs:
        shapes.setdefault((config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]), config)
    return list(shapes.values())


# Per kernel, the configs that compute differently here; the tests below run index i with the i-th of each.
KERNEL_CONFIGS = [_distinct(c) for c in (attention.FWD_CONFIGS, attention.DKDV_CONFIGS, attention.DQ_CONFIGS)]
CONFIG_INDICES = range(max(map(len, KERNEL_CONFIGS)))


def _one_config_each(index, monkeypatch):
    """Every attention kernel launched with its index-th distinct config only (cycling through shorter
    lists), so that every block shape of every kernel runs at some index."""
    fwd, dkdv, dq = (configs[index % len(configs)] for configs in KERNEL_CONFIGS)
    monkeypatch.setattr(attention, "_FWD", _one_config(attention._attn_fwd_kernel, fwd))
    monkeypatch.setattr(attention, "_DKDV", _one_config(attention._attn_bwd_dkdv_kernel, dkdv))
    monkeypatch.setattr(attention, "_DQ", _one_config(attention._attn_bwd_dq_kernel, dq))


# Interpreted, fp16 tiles are upcast to fp32 (the fp32 case already covers that arithmetic); compiled, every
# dtype runs its own tensor-core path.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32] if INTERPRETED else DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("index", CONFIG_INDICES)
def test_every_autotune_config_is_correct(index, causal, dtype, monkeypatch):
    """Autotuning may pick any config, and the interpreter otherwise runs only the first: each block shape
    (BLOCK_M below, equal to and above BLOCK_N; several blocks, a causal diagonal that straddles blocks, a
    ragged tail, a head dim that is not a power of two) must give the same answer. The configs run in
    turn, the i-th of each kernel together; the first H100 run found an fp16 dK error at one of them."""
    _one_config_each(index, monkeypatch)
    try:
        _check_one_config(causal, dtype)
    except triton.runtime.errors.OutOfResources as exc:
        # Compiled, the large fp32 tiles need more shared memory than an H100 has (up to 384 KiB of 227);
        # the autotuner skips such a config (it times it as infinitely slow), so it never runs.
        pytest.skip(f"config {index} does not fit this device in {dtype}: {exc}")


# (seq, head_dim) of each config's check. 131 tokens exceed the largest block (128) with a ragged tail for
# every block size (131 = 128 + 3 = 8 * 16 + 3), so every config tiles several row and column blocks, its
# causal diagonal straddles blocks wherever BLOCK_M != BLOCK_N, and 40 is not a power of two. Interpreted,
# that is all a config changes: the head dim is a whole-array axis (BLOCK_D) that no config sets, so the
# (200, 128) shape, which costs 2.3 times as many block pairs, reaches no other code of a config (head dim
# 128 itself: test_flash_attention_matches_sdpa). Compiled, head dim 128 has its own register and
# shared-memory footprint per config, so both shapes run there.
CONFIG_SHAPES = ((131, 40),) if INTERPRETED else ((200, 128), (131, 40))


def _check_one_config(causal, dtype):
    # Two query heads sharing one kv head: a GQA group, so dK/dV still sum over it. Block shapes decide
    # the row/column tiling of each (batch, head) program alike; the head-to-kv-head mapping itself is
    # config-independent and checked over more heads by test_flash_attention_matches_sdpa.
    for seq, dim in CONFIG_SHAPES:
        q = randn(1, 2, seq, dim, dtype=dtype)
        k = randn(1, 1, seq, dim, dtype=dtype)
        v = randn(1, 1, seq, dim, dtype=dtype)
        got, got_g = forward_backward(
            lambda q, k, v: kernels.flash_attention(q, k, v, causal=causal, impl="triton"), [q, k, v]
        )
        exp, exp_g = forward_backward(
            lambda q, k, v, scale=dim**-0.5: _sdpa64(q, k, v, causal, scale),
            [t.detach().double().requires_grad_() for t in (q, k, v)],
        )
        assert_close(got[0], exp[0], dtype, what=f"output (seq {seq}, dim {dim})")
        for name, a, e in zip("qkv", got_g, exp_g, strict=True):
            assert_close(a, e, dtype, scale=2.0, what=f"grad {name} (seq {seq}, dim {dim})")


# Ring attention's blocks: queries [0, 20) and [20, 48) against keys [0, 13), [13, 30), [30, 48) of one
# causal sequence of 48: fully visible, diagonal-straddling, partly hidden (rows that see no key) and fully
# hidden pairs, none aligned to the kernels' block sizes.
CHUNKS_48 = ([(0, 20), (20, 48)], [(0, 13), (13, 30), (30, 48)])
# The same kinds of pairs for the larger blocks of the other autotune configs (BLOCK_M/BLOCK_N up to 128).
CHUNKS_200 = ([(0, 90), (90, 200)], [(0, 57), (57, 130), (130, 200)])


def _documents(b, seq):
    """Packed-document ids (b, seq): documents of 1 to 13 tokens, so that some rows see no key of a block."""
    lengths = torch.randint(1, 14, (b, seq), generator=torch.Generator().manual_seed(2))
    starts = torch.zeros(b, seq, dtype=torch.bool)
    for row, sizes in zip(starts, lengths.tolist(), strict=True):
        row[torch.tensor(sizes).cumsum(0).clamp(max=seq - 1)] = True
    return starts.long().cumsum(-1)


def _check_blocks_against_whole(dtype, impl, seq, chunks, documents=None, heads=(2, 4, 2)):
    """flash_attention_block's (output, log-sum-exp) per (query chunk, key chunk) pair, merged by
    log-sum-exp, against causal attention over the whole sequence (SDPA in float64; inside packed
    `documents` if given), and flash_attention_block_grads from the merged output and its log-sum-exp,
    summed over the pairs, against its gradient; every block also against the explicit PyTorch block in
    float64, including the -inf log-sum-exp and zero output of rows that see none of a block's keys.
    `heads`: (batch, query heads, kv heads)."""
    q_chunks, k_chunks = chunks
    (b, hq, hk), dim, scale = heads, 16, 0.3
    q, k, v = (randn(b, h, seq, dim, dtype=dtype) for h in (hq, hk, hk))
    exp, exp_g = forward_backward(
        lambda q, k, v: _sdpa64(q, k, v, True, scale, documents),
        [t.detach().double().requires_grad_() for t in (q, k, v)],
    )

    def allowed(q0, q1, k0, k1):
        if documents is None:
            return None
        return same_document(documents[:, q0:q1], documents[:, k0:k1]).to(DEVICE)

    do = torch.randn(b, hq, seq, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    do = do.half().to(DEVICE, dtype)  # forward_backward's cotangent: the same seed, rounded the same way
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    outs, lses = [], []
    for q0, q1 in q_chunks:
        out = lse = None
        for k0, k1 in k_chunks:
            args = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], True, scale, q0, k0)
            o, lo = kernels.flash_attention_block(*args, impl=impl, allowed=allowed(q0, q1, k0, k1))
            want_o, want_lse = kernels.reference.attention_block(
                q64[:, :, q0:q1], k64[:, :, k0:k1], v64[:, :, k0:k1], True, scale, q0, k0,
                allowed(q0, q1, k0, k1),
            )  # fmt: skip
            assert o.dtype == lo.dtype == torch.float32
            assert torch.equal(lo.isinf(), want_lse.isinf()), f"rows without keys, block q{q0} k{k0}"
            assert_close(o, want_o, dtype, what=f"block output q{q0} k{k0}")
            seen = want_lse.isfinite()
            assert_close(lo[seen], want_lse[seen], dtype, what=f"block lse q{q0} k{k0}")
            if out is None:
                out, lse = o, lo
            else:
                # Rows that have seen no key yet (in a document that starts later) keep -inf and 0.
                new = torch.logaddexp(lse, lo)
                shift = new.masked_fill(new == -torch.inf, 0.0)
                out = out * (lse - shift).exp()[..., None] + o * (lo - shift).exp()[..., None]
                lse = new
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
    assert_close(out, exp[0], dtype, what="merged output")
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for q0, q1 in q_chunks:
        for k0, k1 in k_chunks:
            dq, dk, dv = kernels.flash_attention_block_grads(
                do[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], lse[:, :, q0:q1],
                out[:, :, q0:q1], True, scale, q0, k0, impl=impl, allowed=allowed(q0, q1, k0, k1),
            )  # fmt: skip
            grads[0][:, :, q0:q1] += dq.cpu().double()
            grads[1][:, :, k0:k1] += dk.cpu().double()
            grads[2][:, :, k0:k1] += dv.cpu().double()
    # Gradients sum products over the sequence (and over a GQA group for dk/dv): allow 2x, as above.
    for name, a, e in zip("qkv", grads, exp_g, strict=True):
        assert_close(a, e.cpu(), dtype, scale=2.0, what=f"grad {name}")


@pytest.mark.slow  # multi-second (5 s a case, interpreted, on two idle cores): runs in CI only
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_blocks_merged_by_lse_equal_whole_attention(dtype, impl):
    _check_blocks_against_whole(dtype, impl, 48, CHUNKS_48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_blocks_inside_packed_documents_equal_whole_attention(dtype):
    """The PyTorch path's `allowed` mask (the fused CPU kernel's additive mask on CPU), with documents
    short enough that whole rows of a block see no key; bf16 inputs are computed in fp32, so the bf16
    case needs no interpreter skip."""
    _check_blocks_against_whole(dtype, "torch", 48, CHUNKS_48, _documents(2, 48))


def test_cpu_attention_blocks_run_the_fused_kernel(monkeypatch):
    """On CPU tensors the PyTorch block path never falls back to the explicit one (whose score-sized
    temporaries made ring attention's blocks several times slower than one rank's SDPA)."""

    def explicit(*args, **kwargs):
        raise AssertionError("the explicit block path ran on CPU tensors")

    monkeypatch.setattr(kernels.reference, "attention_block", explicit)
    monkeypatch.setattr(kernels.reference, "attention_block_grads", explicit)
    q = torch.randn(1, 2, 8, 16)
    allowed = torch.ones(1, 8, 8, dtype=torch.bool)
    for q_offset, k_offset, mask in ((0, 0, None), (8, 0, None), (4, 0, None), (0, 0, allowed)):
        o, lse = kernels.flash_attention_block(q, q, q, True, None, q_offset, k_offset, "torch", allowed=mask)
        grads = kernels.flash_attention_block_grads(
            q, q, q, q, lse, o, True, None, q_offset, k_offset, "torch", allowed=mask
        )
        assert all(g.shape == q.shape for g in grads)


@pytest.mark.slow
@pytest.mark.parametrize("index", CONFIG_INDICES)
def test_every_autotune_config_gets_block_offsets_right(index, monkeypatch):
    """The stage bounds shifted by the block offsets, for every block shape autotuning may pick (fp32).
    One sequence of two query heads sharing a kv head (a GQA group, so dK/dV still sum over it): the
    interpreter runs every (batch, head) program in turn, and block shapes tile the rows and columns of
    each alike, so the 2 x 4 heads the fixed-config cases above use (CHUNKS_48: batch and kv-head
    strides, two GQA groups) cost 4x and reach no other code of a config."""
    _one_config_each(index, monkeypatch)
    _check_blocks_against_whole(torch.float32, "triton", 200, CHUNKS_200, heads=(1, 2, 1))


def test_triton_attention_block_refuses_document_masks():
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    allowed = torch.ones(1, 8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="no `allowed` mask"):
        kernels.flash_attention_block(q, q, q, impl="triton", allowed=allowed)
