"""Fused kernels with one dispatch point.

Each public function takes `impl`: "torch" runs the plain PyTorch reference, "triton" the Triton
kernel (under TRITON_INTERPRET=1 on CPU tensors), "auto" Triton on CUDA and PyTorch elsewhere.
Model code calls these functions and never branches on the device itself.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.dispatch import resolve_impl

__all__ = [
    "apply_rotary",
    "cross_entropy",
    "flash_attention",
    "fused_linear_cross_entropy",
    "geglu",
    "layer_norm",
    "resolve_impl",
    "rms_norm",
    "swiglu",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "auto") -> torch.Tensor:
    if resolve_impl(impl, x) == "triton":
        raise NotImplementedError("triton rms_norm lands with the kernels issue")
    return reference.rms_norm(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, impl: str = "auto"
) -> torch.Tensor:
    if resolve_impl(impl, x) == "triton":
        raise NotImplementedError("triton layer_norm lands with the kernels issue")
    return reference.layer_norm(x, weight, bias, eps)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, impl: str = "auto"
) -> torch.Tensor:
    if resolve_impl(impl, x) == "triton":
        raise NotImplementedError("triton apply_rotary lands with the kernels issue")
    return reference.apply_rotary(x, cos, sin, interleaved)


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    if resolve_impl(impl, gate) == "triton":
        raise NotImplementedError("triton swiglu lands with the kernels issue")
    return reference.swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    if resolve_impl(impl, gate) == "triton":
        raise NotImplementedError("triton geglu lands with the kernels issue")
    return reference.geglu(gate, up)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    if resolve_impl(impl, q) == "triton":
        raise NotImplementedError("triton flash_attention lands with the kernels issue")
    return reference.flash_attention(q, k, v, causal, softmax_scale)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    tp_group: object | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    if tp_group is not None or resolve_impl(impl, logits) == "triton":
        raise NotImplementedError("vocab-parallel / triton cross_entropy lands with the kernels issue")
    return reference.cross_entropy(logits, target, ignore_index)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, impl: str = "auto"
) -> torch.Tensor:
    if resolve_impl(impl, hidden) == "triton":
        raise NotImplementedError("triton fused_linear_cross_entropy lands with the kernels issue")
    return reference.fused_linear_cross_entropy(hidden, weight, target, ignore_index)
