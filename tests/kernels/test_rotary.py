"""Rotary Triton kernel vs transformers' rotary (LLaMA half-rotated, ERNIE-4.5 interleaved) in float64."""

from __future__ import annotations

import pytest
import torch
from transformers.models.ernie4_5 import modeling_ernie4_5 as hf_ernie
from transformers.models.llama import modeling_llama as hf_llama

import kernels
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, forward_backward, randn


def _angles(positions: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    # transformers' default rope: inv_freq = theta^(-2i/d), angles = positions x inv_freq.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)


def _tables(positions: int, dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin laid out for kernels.apply_rotary: [a, a] (LLaMA) or [a0, a0, a1, a1, ...] (ERNIE)."""
    a = _angles(positions, dim)
    emb = a.repeat_interleave(2, dim=-1) if interleaved else torch.cat((a, a), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def _hf_reference(x: torch.Tensor, positions: slice, interleaved: bool) -> torch.Tensor:
    """transformers' rotary in float64 on x (batch, seq, heads, dim), using HF's cos/sin [a, a] layout."""
    a = _angles(positions.stop, x.shape[-1])[positions].to(x.device)
    cos, sin = torch.cat((a, a), -1)[None], torch.cat((a, a), -1)[None]
    cos, sin = cos.cos(), sin.sin()
    if not interleaved:
        out, _ = hf_llama.apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
        return out
    # ERNIE's apply_rotary_pos_emb upcasts to fp32: reuse its rotate_half and cos/sin re-layout in float64.
    half = cos.shape[-1] // 2
    cos_i = cos[..., :half].repeat_interleave(2, -1).unsqueeze(2)
    sin_i = sin[..., :half].repeat_interleave(2, -1).unsqueeze(2)
    return x * cos_i + hf_ernie.rotate_half(x) * sin_i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "batch,seq,q_heads,kv_heads,dim,offset",
    [(2, 7, 4, 2, 16, 0), (1, 5, 3, 1, 64, 11), (2, 3, 6, 6, 128, 2), (1, 9, 5, 3, 24, 4)],
)
def test_rotary_matches_transformers(batch, seq, q_heads, kv_heads, dim, offset, interleaved, dtype):
    cos, sin = _tables(offset + seq + 3, dim, interleaved)  # a longer table, read from row `offset`
    for heads in (q_heads, kv_heads):  # q and k carry different head counts
        x = randn(batch, seq, heads, dim, dtype=dtype)
        got, got_g = forward_backward(
            lambda x: kernels.apply_rotary(
                x, cos.float(), sin.float(), interleaved, "triton", position_offset=offset
            ),
            [x],
        )
        x64 = x.detach().double().requires_grad_()
        exp, exp_g = forward_backward(
            lambda x: _hf_reference(x, slice(offset, offset + seq), interleaved), [x64]
        )
        assert got[0].dtype == dtype
        assert_close(got[0], exp[0], dtype, what="output")
        assert_close(got_g[0], exp_g[0], dtype, what="grad x")


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_torch_impl_matches_triton_with_offset(interleaved):
    cos, sin = _tables(12, 32, interleaved)
    x = randn(2, 6, 3, 32, dtype=torch.float32, grad=False)
    a = kernels.apply_rotary(x, cos.float(), sin.float(), interleaved, "torch", position_offset=5)
    b = kernels.apply_rotary(x, cos.float(), sin.float(), interleaved, "triton", position_offset=5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_rotary_rejects_short_table():
    cos, sin = _tables(8, 16, False)
    with pytest.raises(ValueError, match="position_offset"):
        kernels.apply_rotary(
            torch.randn(1, 6, 2, 16), cos.float(), sin.float(), impl="torch", position_offset=4
        )
