"""The three GEMMs of a linear layer (output, input gradient, weight gradient), in the compute dtype or in
float8, and the autograd function every llmtrain linear layer runs them through.

``LinearGemms`` are torch's own matmuls. ``Float8Gemms`` cast each operand to float8 with torchao's
dynamic scaling (``tensor_to_amax`` -> ``amax_to_scale`` -> ``hp_tensor_and_scale_to_float8``) and multiply
the resulting ``Float8TrainingTensor`` s, which torchao dispatches to ``torch._scaled_mm``: the same casts
and products, in the same layouts, as torchao's ``matmul_with_hp_or_float8_args`` (a one-process layer
gives bitwise its results, tests/parallel/test_float8_layouts.py). What torchao's ``Float8Linear`` cannot
know is that a layer's operands may be slices of the tensors one process would cast: a tensor-parallel
weight holds 1/tp of the output (column) or input (row) features, its output gradient 1/tp of the output
features, and under context parallelism (or a mixture of experts' layer under TP, which routes 1/tp of
the tokens) every activation holds part of the tokens. So each scale's amax is all-reduced (MAX) over the
groups that split the dimensions it is taken over: for tensorwise scaling the whole tensor's, for rowwise
scaling only the reduced axis (a row's amax over the input features of a column-parallel input is local;
over the output features of a column-parallel output gradient it spans the TP group). With every amax
global, every rank quantises its slice exactly as one process quantises the whole tensor: the float8
operands are bitwise those of one process, and only the fp32 accumulation of the GEMMs (and the sums of
row-parallel partial products) runs in another order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.parallel.comm import all_gather_dim, all_reduce, group_size


class LinearGemms:
    """A linear layer's GEMMs in the compute dtype: exactly what F.linear and its autograd do."""

    def output(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grad.matmul(weight)

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(out, in) from the flattened (tokens, out) output gradient and (tokens, in) input."""
        return grad.t().matmul(x)


PLAIN = LinearGemms()


@dataclass
class Float8Gemms(LinearGemms):
    """The GEMMs of one linear layer in float8, as torchao's ``config`` (a Float8LinearConfig) says.
    ``token_groups``: the process groups splitting the tokens (rows of the input and output gradient);
    ``in_group`` / ``out_group``: the one splitting the input / output features (row / column parallel)."""

    config: Any
    token_groups: tuple[Any, ...] = ()
    in_group: Any = None
    out_group: Any = None

    def __post_init__(self) -> None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        c = self.config
        gemm = [c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight]
        self.mm_config = LinearMMConfig(
            *(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemm)
        )

    def _cast(
        self, t: torch.Tensor, cast: Any, role: Any, dim: int, groups: tuple[tuple, tuple]
    ) -> torch.Tensor:
        """``t`` (2-D) as a Float8TrainingTensor; ``groups``: those splitting its dims 0 and 1; ``dim``: the
        dim a rowwise amax is taken over (torchao's axiswise_dim; unused by tensorwise scaling)."""
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if cast.scaling_type is ScalingType.DISABLED or isinstance(t, Float8TrainingTensor):
            return t  # (a weight FSDP2 gathered in float8 already, llmtrain.parallel.float8_gather)
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        axis = dim if rowwise else None
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=axis)
        spanning = groups[axis % 2] if rowwise else groups[0] + groups[1]
        reduced = [g for g in spanning if group_size(g) > 1]
        if reduced:
            amax = amax.float()  # exact: a bf16 amax is an fp32 value, and the MAX of exact values is exact
            for group in reduced:
                all_reduce(amax, op=dist.ReduceOp.MAX, group=group, detail="float8 amax")
        scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, self.mm_config, role, axis)

    def _groups(self) -> tuple[tuple, tuple, tuple]:
        tokens = self.token_groups
        features_in = (self.in_group,) if self.in_group is not None else ()
        features_out = (self.out_group,) if self.out_group is not None else ()
        return tokens, features_in, features_out

    def output(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        tokens, fin, fout = self._groups()
        x2 = x.reshape(-1, x.shape[-1])
        x8 = self._cast(x2, c.cast_config_input, GemmInputRole.INPUT, -1, (tokens, fin))
        w8 = self._cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, (fin, fout))
        out = torch.mm(x8, w8).reshape(*x.shape[:-1], weight.shape[0])
        return out + bias.to(out.dtype) if bias is not None else out

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        tokens, fin, fout = self._groups()
        g2 = grad.reshape(-1, grad.shape[-1])
        g8 = self._cast(g2, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, (tokens, fout))
        w8 = self._cast(
            weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, (fin, fout)
        )
        return torch.mm(g8, w8.t()).reshape(*grad.shape[:-1], weight.shape[1])

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        tokens, fin, fout = self._groups()
        g8 = self._cast(
            grad, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, (tokens, fout)
        )
        x8 = self._cast(x, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, (tokens, fin))
        return torch.mm(g8.t(), x8)


class _Linear(torch.autograd.Function):
    """x @ weight^T + bias through ``gemms``. With ``shard`` (x is its sequence-parallel all-gather over
    ``group``) only the shard is kept, x is re-gathered in backward: what lets sequence parallelism divide
    the saved inputs of column-parallel layers by tp (Korthikanti et al. 2022, 4.2.2); the gradient of x
    flows back through the gather (a reduce-scatter)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shard: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Any,
        gemms: LinearGemms,
    ) -> torch.Tensor:
        ctx.group, ctx.has_bias, ctx.gemms, ctx.gathered = group, bias is not None, gemms, shard is not None
        ctx.save_for_backward(x if shard is None else shard, weight)
        return gemms.output(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        if ctx.gathered:
            x = all_gather_dim(x, 1, ctx.group)
        grad_x = ctx.gemms.grad_input(grad, weight)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = ctx.gemms.grad_weight(flat_grad, x.reshape(-1, x.shape[-1]))
        grad_b = flat_grad.sum(0) if ctx.has_bias else None
        return grad_x, None, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemms: LinearGemms = PLAIN,
    shard: torch.Tensor | None = None,
    group: Any = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) through ``gemms``; with ``shard``, x is its all-gather over ``group`` and
    only the shard is saved for backward."""
    if gemms is PLAIN and shard is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, shard, weight, bias, group, gemms)
