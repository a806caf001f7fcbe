"""Choosing between the Triton and PyTorch implementations."""

from __future__ import annotations

import importlib.util
import os

import torch

IMPLS = ("auto", "triton", "torch")


# Looked up once: torch.compile (2.11) cannot trace importlib.util.find_spec, so a look-up per kernel call
# broke every compiled transformer block into pieces at each kernel (19 ms of host gaps a LLaMA-1B step on
# an H200, 223 ms at 3B in fp8).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and can run here: compiled on CUDA, or interpreted with TRITON_INTERPRET=1."""
    return _TRITON_INSTALLED


def resolve_impl(impl: str, tensor: torch.Tensor, auto_on_cuda: str = "triton") -> str:
    """'auto' -> `auto_on_cuda` on CUDA tensors (Triton needs to be installed for 'triton'), else 'torch';
    explicit ones are checked. An op whose PyTorch path is measured faster on GPUs passes 'torch'."""
    if impl not in IMPLS:
        raise ValueError(f"kernel impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "torch":
        return "torch"
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' needs the triton package; install it or use impl='torch'")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "impl='triton' on a CPU tensor needs TRITON_INTERPRET=1 (the Triton interpreter); "
                "set it or use impl='auto'"
            )
        return "triton"
    if not tensor.is_cuda:
        return "torch"
    return "triton" if auto_on_cuda == "triton" and triton_available() else "torch"
