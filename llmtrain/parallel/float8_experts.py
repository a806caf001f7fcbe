"""The routed experts' grouped GEMMs in float8 (``train.fp8_grouped_mm`` under train.precision=fp8).

torchao's MoE training (torchao.prototype.moe_training) provides the two grouped GEMMs torchtitan runs:

  - ``rowwise`` (its recipe FP8_ROWWISE, ``Float8TrainingOpConfig``): e4m3 operands with one scale per
    row of the tokens and per column of each expert's weight, on ``torch._scaled_grouped_mm`` -- a CUDA
    kernel of compute capability 9.0+ (Hopper);
  - ``mxfp8`` (``MXFP8TrainingOpConfig``): e4m3 elements with one power-of-2 (e8m0) scale per block of 32
    along the reduction dimension; recipe MXFP8_RCEIL on Blackwell (compute capability 10.0+: its CUTLASS
    kernels), MXFP8_EMULATED_RCEIL elsewhere, CPU included -- torchao's own emulation: the same
    quantisation, then the dequantised products in bf16 (slow, the numerics of the recipe).

``auto`` picks rowwise on Hopper, mxfp8 on Blackwell and the bf16 grouped GEMM elsewhere (the CPU, Ada), and
the startup ``precision`` line says which runs. Both recipes quantise the forward product, the input
gradient and the weight gradient: three float8 grouped GEMMs per projection.

How it is applied: torchao wraps each expert weight in a tensor subclass (``quantize_`` with the config
above) whose ``torch._grouped_mm`` override calls its ``_quantize_then_scaled_grouped_mm`` with the config.
llmtrain's parameters are views of the flat data-parallel buffers, FSDP2 shards, or EP slices marked with
their place; swapping their type would leave those, so the experts call that same torchao function with
the same config directly, on the weights as the layout hands them (the bf16 view, FSDP2's gathered copy,
this EP rank's experts). Token groups are padded to the recipe's block (``pad_token_groups_for_grouped_mm``):
how many tokens an expert gets is data-dependent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import kernels
from llmtrain.config.engine_rules import grouped_mm_misfit
from llmtrain.config.schema import ModelConfig, TrainConfig
from llmtrain.models.moe import Experts


def resolve_grouped_mm(setting: str, device: torch.device | str, model: ModelConfig) -> str:
    """The grouped GEMM ``train.fp8_grouped_mm=setting`` runs on ``device``: rowwise, mxfp8 or bf16. An
    explicit choice is taken as it is (validation refused the dims it cannot take); auto falls back to bf16
    where the model's dims are not multiples of its recipe's (engine_rules.grouped_mm_misfit)."""
    if setting != "auto":
        return setting
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return "bf16"
    major = torch.cuda.get_device_capability(device)[0]
    mode = "mxfp8" if major >= 10 else "rowwise" if major == 9 else "bf16"
    return "bf16" if grouped_mm_misfit(mode, model) else mode


def grouped_mm_device_problem(setting: str, device: torch.device | str) -> str:
    """Why ``train.fp8_grouped_mm=setting`` cannot run on ``device`` ("" if it can)."""
    if setting != "rowwise":
        return ""
    device = torch.device(device)
    capable = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    if capable and hasattr(torch, "_scaled_grouped_mm"):
        return ""
    return (
        f"train.fp8_grouped_mm=rowwise needs torch._scaled_grouped_mm on a CUDA device of compute capability "
        f"9.0+ (Hopper), not {device}; use train.fp8_grouped_mm=mxfp8 (emulated off Blackwell) or bf16"
    )


def torchao_config(mode: str, device: torch.device | str) -> Any:
    """torchao's op config of grouped GEMM ``mode`` (rowwise or mxfp8) on ``device``, token groups padded."""
    from torchao.prototype.moe_training.config import (
        Float8TrainingOpConfig,
        Float8TrainingRecipe,
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )

    if mode == "rowwise":
        config = Float8TrainingOpConfig.from_recipe(Float8TrainingRecipe.FP8_ROWWISE)
    else:
        device = torch.device(device)
        blackwell = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
        recipe = MXFP8TrainingRecipe.MXFP8_RCEIL if blackwell else MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL
        config = MXFP8TrainingOpConfig.from_recipe(recipe)
    config.pad_token_groups_for_grouped_mm = True
    return config


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torchao's grouped GEMM backward needs one;
    the combine's gather hands back a strided one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@dataclass
class Float8GroupedMM:
    """An Experts module's ``grouped_mm``: the SwiGLU experts with both projections in float8."""

    config: Any
    impl: str

    def _mm(self, a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

        # weight (E, N, K) -> the (E, K, N) column-major operand torchao takes (the transposed view).
        out = _quantize_then_scaled_grouped_mm(a, weight.transpose(-2, -1), self.config, offs=offsets)
        return _ContiguousGrad.apply(out)

    def __call__(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor | Sequence[int],
        gate_up: torch.Tensor,
        down: torch.Tensor,
    ) -> torch.Tensor:
        if not rows.shape[0]:
            return kernels.moe_experts(rows, counts, gate_up, down, impl=self.impl)
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts, device=rows.device)
        offsets = counts.to(rows.device).cumsum(0, dtype=torch.int32)
        gu = self._mm(rows, gate_up, offsets)
        h = kernels.swiglu(*gu.chunk(2, dim=-1), impl=self.impl)
        return self._mm(h.contiguous(), down, offsets)


def apply_float8_experts(
    model: nn.Module, model_config: ModelConfig, train: TrainConfig, device: torch.device | str
) -> str:
    """Under fp8, make every Experts module of ``model`` run its grouped GEMMs as train.fp8_grouped_mm
    resolves on ``device``; returns that choice (rowwise, mxfp8, or bf16: nothing changed)."""
    mode = resolve_grouped_mm(train.fp8_grouped_mm, device, model_config)
    if mode == "bf16":
        return mode
    config = torchao_config(mode, device)
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped_mm = Float8GroupedMM(config, module.impl)
    return mode
