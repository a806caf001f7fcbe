"""The zero-bubble schedules' split backward: input gradients now (I), weight gradients later (W).

While a split-backward schedule's F or I runs, the linear layers (plain ``nn.Linear``, llmtrain's
Float8Linear and the tensor-parallel column/row layers alike, routed here by ``defer_weight_grads``) build
a graph whose backward returns the input gradient only and hands each layer's (input, output-gradient)
pair to ``SplitBackward``; the executor's W action turns them into weight gradients (``accumulate``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from llmtrain.parallel.float8 import Float8Linear
from llmtrain.parallel.gemms import PLAIN, LinearGemms, linear
from llmtrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, gather_sequence
from llmtrain.parallel.thread_state import CallerLocal

_LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class WeightGrad:
    """The weight (and bias) gradient of one linear layer for one micro-batch, waiting for its W action.
    ``x`` is the layer's input, or under sequence parallelism this rank's shard of it, all-gathered over
    ``group`` when the W runs (every TP rank runs the same actions, so the gathers line up)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    x: torch.Tensor
    grad: torch.Tensor
    group: Any = None
    gemms: LinearGemms = PLAIN

    def compute(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient) pairs: grad^T x for the weight (through the layer's gemms: in float8 under
        train.precision=fp8, as the layer's own backward computes it), the sum of grad for the bias."""
        x = self.x
        if self.group is not None:
            with torch.no_grad():
                x = gather_sequence(x, self.group)
        g2, x2 = self.grad.reshape(-1, self.grad.shape[-1]), x.reshape(-1, x.shape[-1])
        out = [(self.weight, self.gemms.grad_weight(g2, x2))]
        if self.bias is not None:
            out.append((self.bias, g2.sum(0)))
        return out


def accumulate(work: list[WeightGrad]) -> None:
    """Accumulate weight/bias gradients through autograd, so gradient hooks (DP buckets) run."""
    pairs = [pair for item in work for pair in item.compute()]
    if pairs:
        params, grads = zip(*pairs, strict=True)
        torch.autograd.backward(list(params), list(grads))


class SplitBackward:
    """One executor's zero-bubble state. While ``building`` (a split-backward schedule's F or I,
    recomputation included) the patched linear layers build the deferrable graph; other executors
    sharing the modules see plain layers. ``building`` is the calling thread's (a pair's forward runs on a
    thread of its own); a thread that never set it (autograd's on a GPU, recomputing inside an I) reads
    the caller's, waiting ``in_backward`` (llmtrain.parallel.thread_state). While an I runs, ``queue``
    collects its weight-gradient work for the matching W (read by autograd's thread); outside of one the work
    is done at once."""

    def __init__(self) -> None:
        self._thread = CallerLocal(building=False)
        self.queue: list[WeightGrad] | None = None

    @property
    def building(self) -> bool:
        return self._thread.get("building")

    @building.setter
    def building(self, on: bool) -> None:
        self._thread.set("building", on)

    def in_backward(self) -> contextlib.AbstractContextManager[None]:
        """While the calling thread waits in a backward, threads of autograd's build as it does."""
        return self._thread.lent()

    def take(self, work: WeightGrad) -> None:
        if self.queue is not None:
            self.queue.append(work)
        else:
            accumulate([work])


class _DeferrableLinear(torch.autograd.Function):
    """The layer's linear (through its ``gemms``) whose backward returns the input gradient only and hands
    the weight/bias gradient to ``split``. The parameters enter detached, so autograd's own graph has no
    edge to them (their gradient hooks must run once, when the gradient really arrives); ``params`` are
    the real leaves. With ``shard`` (x is its sequence-parallel all-gather over ``group``) only the shard
    is kept, as the TP layer does."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        shard: torch.Tensor | None,
        group: Any,
        params: tuple[nn.Parameter, nn.Parameter | None],
        split: SplitBackward,
        gemms: LinearGemms,
    ) -> torch.Tensor:
        ctx.save_for_backward(x if shard is None else shard, weight)
        ctx.group = None if shard is None else group
        ctx.params, ctx.split, ctx.gemms = params, split, gemms
        return gemms.output(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = ctx.gemms.grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        ctx.split.take(WeightGrad(ctx.params[0], ctx.params[1], x, grad, ctx.group, ctx.gemms))
        return grad_x, None, None, None, None, None, None, None


def split_linear(
    split: SplitBackward,
    plain: _LinearFn,
    group: Any,
    gemms: LinearGemms,
    x: torch.Tensor,
    weight: nn.Parameter,
    bias: nn.Parameter | None,
) -> torch.Tensor:
    """``plain(x, weight, bias)``, or while ``split.building`` the same product (through ``gemms``) with a
    deferrable weight gradient. ``group``: the TP group a sequence-parallel input is gathered over (None
    for nn.Linear)."""
    if not split.building:
        return plain(x, weight, bias)
    shard = getattr(x, "sequence_shard", None) if group is not None else None
    detached_bias = bias.detach() if bias is not None else None
    return _DeferrableLinear.apply(
        x, weight.detach(), detached_bias, shard, group, (weight, bias), split, gemms
    )


def _plain_linear(module: nn.Module) -> bool:
    """``nn.Linear`` itself or llmtrain's Float8Linear, not another subclass with a forward of its own;
    also once fully_shard has made it an FSDP unit (the output layer at zero 2/3), whose class FSDPLinear
    only adds FSDPModule's methods."""
    cls = type(module)
    if cls.__bases__[0] is FSDPModule:
        cls = cls.__bases__[-1]
    return cls in (nn.Linear, Float8Linear)


def _split_linear_forward(split: SplitBackward, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    gemms = getattr(module, "gemms", PLAIN)
    plain = functools.partial(linear, gemms=gemms)
    return split_linear(split, plain, None, gemms, x, module.weight, module.bias)


def defer_weight_grads(split: SplitBackward, chunks: Sequence[nn.Module]) -> None:
    """Route the linear layers of ``chunks`` (``nn.Linear``, TP column/row parallel) through
    ``split_linear``; a weight shared with another module (a tied head) keeps its gradient in I, so each
    parameter gets it from one kind of action only."""
    modules = [module for chunk in chunks for module in chunk.modules()]
    uses: dict[int, int] = {}
    for module in modules:
        for p in module.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    for module in modules:
        if uses.get(id(getattr(module, "weight", None)), 0) != 1:
            continue
        if _plain_linear(module):
            module.forward = functools.partial(_split_linear_forward, split, module)
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.linear = functools.partial(split_linear, split, module.linear, module.group, module.gemms)
