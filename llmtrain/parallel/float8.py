"""train.precision=fp8: the transformer blocks' linear layers compute their GEMMs in float8, at every layout.

Every GEMM of a block's linear layers -- plain ``nn.Linear`` and the tensor-parallel column/row layers
alike -- runs through llmtrain.parallel.gemms.Float8Gemms: torchao's dynamic scaling and its float8 tensor
(``torch._scaled_mm``), with each amax all-reduced over the process groups that split the tensor it
scales, so every rank quantises exactly as one process would (see gemms.py). ``train.fp8_recipe`` picks
torchao's recipe: ``tensorwise`` (its and torchtitan's default: one scale per tensor; e4m3 inputs and
weights, e5m2 output gradients) or ``rowwise`` (a scale per row of each operand, rounded down to a power of
2, all e4m3). Parameters stay bf16 views of the flat buffers (or FSDP2's bf16 gathers), the optimizer keeps
fp32 masters, and norms, attention, SwiGLU and the loss run as bf16 training runs them.

What stays bf16, whatever the recipe:
  - the output layer: the logits feed the softmax directly (torchtitan leaves ``output`` out too), and the
    vocabulary need not be a multiple of 16;
  - the router of a mixture of experts (a Router, not a linear layer): its scores choose the experts;
  - the experts' grouped GEMM where ``train.fp8_grouped_mm`` resolves to bf16 (``auto`` off Hopper and
    Blackwell, the CPU included): kernels.moe_experts in bf16, the stated fallback. Elsewhere torchao's
    float8 rowwise or MXFP8 grouped GEMM runs (llmtrain.parallel.float8_experts). Shared experts are plain
    linear layers and run in float8.
  - with ``train.fp8_filter=auto``, the layers torchao's performance tables find slower in float8 on H100
    (``small_gemm``): judged by the layer's full weight shape (N out, K in features), tensorwise keeps bf16
    when K <= 4096 and N <= 1024; rowwise when N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048.

Exceptions to "as one process": a replicated linear whose output gradient is a per-rank partial sum --
latent attention's down-projections under tp > 1, each rank's gradient coming from its own heads -- casts
that partial sum, which one process casts only once summed: the same recipe, but per TP rank there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmtrain.config.engine_rules import small_gemm
from llmtrain.config.schema import TrainConfig
from llmtrain.config.validate import raise_if_problem
from llmtrain.models.moe import MoEMLP
from llmtrain.parallel.float8_experts import apply_float8_experts, grouped_mm_device_problem
from llmtrain.parallel.gemms import Float8Gemms, LinearGemms, linear
from llmtrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from llmtrain.parallel.topology import Topology


class Float8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run through ``gemms`` (float8); same parameters, same names. apply_float8
    turns a block's nn.Linear into one in place (its class only: weights, hooks and FSDP state stay)."""

    gemms: LinearGemms

    def forward(self, x: Any) -> Any:
        return linear(x, self.weight, self.bias, self.gemms)


def float8_config(recipe: str) -> Any:
    """torchao's Float8LinearConfig of ``train.fp8_recipe`` (its own recipe of that name)."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)


def _full_shape(module: nn.Module, topo: Topology) -> tuple[int, int]:
    """(out, in) features of the layer one process holds."""
    out, in_ = module.weight.shape
    if isinstance(module, ColumnParallelLinear):
        return out * topo.tp, in_
    if isinstance(module, RowParallelLinear):
        return out, in_ * topo.tp
    return out, in_


def float8_device_problem(device: torch.device | str) -> str:
    """Why float8 GEMMs cannot run on ``device`` with this torch ("" if they can): torch._scaled_mm runs on
    CPU, and on CUDA devices of compute capability 8.9 or above (Ada, Hopper, Blackwell)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"train.precision=fp8 needs torch with float8 (2.4+, not {torch.__version__}); use bf16"
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return (
                f"train.precision=fp8 needs float8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                f"{name} has {major}.{minor}: use train.precision=bf16"
            )
    return ""


def apply_float8(model: nn.Module, topo: Topology, train: TrainConfig) -> nn.Module:
    """With train.precision 'fp8', make the blocks' linear layers compute in float8, in place (after
    apply_tp/apply_ep/apply_cp: it reads which groups split each layer's operands). Tokens are split over
    CP, and within a mixture of experts' layer under TP over TP too (each TP rank routes 1/tp of them)."""
    if train.precision != "fp8":
        return model
    raise_if_problem(float8_device_problem(topo.device))
    raise_if_problem(grouped_mm_device_problem(train.fp8_grouped_mm, topo.device))
    apply_float8_experts(model, model.config, train, topo.device)
    config = float8_config(train.fp8_recipe)
    cp = (topo.cp_group,) if topo.cp > 1 else ()
    tp = topo.tp_group if topo.tp > 1 else None
    for block in model.layers:
        routed = {id(m) for m in block.mlp.modules()} if isinstance(block.mlp, MoEMLP) and tp else set()
        for module in block.modules():
            kind = type(module)
            if kind not in (nn.Linear, ColumnParallelLinear, RowParallelLinear):
                continue
            if train.fp8_filter == "auto" and small_gemm(train.fp8_recipe, *_full_shape(module, topo)):
                continue
            tokens = cp + ((tp,) if id(module) in routed else ())
            gemms = Float8Gemms(
                config,
                tokens,
                in_group=tp if kind is RowParallelLinear else None,
                out_group=tp if kind is ColumnParallelLinear else None,
            )
            module.gemms = gemms
            if kind is nn.Linear:
                module.__class__ = Float8Linear
    return model
