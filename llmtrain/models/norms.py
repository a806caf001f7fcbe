"""Normalisation layers over the last dimension, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    """RMSNorm with statistics in fp32 (as LLaMA/ERNIE compute it)."""

    def __init__(self, hidden: int, eps: float, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))
        self.eps = eps
        self.impl = impl

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) with the add fused into the kernel."""
        return kernels.rms_norm(x, self.weight, self.eps, impl=self.impl, residual=residual)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dimension."""

    def __init__(self, hidden: int, eps: float, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))
        self.bias = nn.Parameter(torch.empty(hidden))
        self.eps = eps
        self.impl = impl

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) with the add fused into the kernel."""
        return kernels.layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl, residual=residual)
