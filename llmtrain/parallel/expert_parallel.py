"""Expert parallelism: each MoE layer's experts sharded over the EP group, tokens exchanged by all-to-all.

Rank r of an EP group of size ep holds experts [r * E / ep, (r + 1) * E / ep) of every MoE layer (the
expert-domain numbering is llmtrain.parallel.topology's). Everything else (attention, norms, routers, shared
experts) stays replicated: EP ranks are data-parallel replicas of it, each routing its own micro-batch.
A rank routes its tokens as one process would (the router, the capacity over its own tokens, the router
statistics: none of them changes under EP), sorts the (token, expert) assignments by expert, and then
`ExpertDispatch`:

1. exchanges the per-expert counts (all_to_all_single of E integers),
2. sends each EP rank the rows routed to its experts (all_to_all_single with variable splits; the
   autograd backward is the reverse exchange),
3. regroups the received rows by local expert, runs the local experts on them (`Experts.compute`:
   kernels.moe_experts, or the float8 grouped GEMM),
4. and sends the outputs back the same way, where the caller combines them with the router weights.

The gradient of a local expert sums the contributions of every EP rank's tokens: with the loss a mean over
data-parallel ranks, the expert gradients are summed over the expert-data-parallel group and divided by the
data-parallel degree (llmtrain.parallel.data_parallel), as dense gradients are averaged over DP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.models.moe import Experts
from llmtrain.parallel.comm import all_to_all_single
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.turns import handoff


def _all_to_all(
    x: torch.Tensor, send: list[int], receive: list[int], group: Any, detail: str
) -> torch.Tensor:
    """Rows [sum(send[:i]), sum(send[:i + 1])) of `x` to the group's rank i; returns the rows received,
    receive[i] of them from rank i, in rank order. Inside an overlapped pair (llmtrain.parallel.turns) the
    exchange runs while the pair's other computation has the turn."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    rows = x.contiguous()
    handoff(
        lambda async_op: all_to_all_single(
            out, rows, group, async_op, detail, output_split_sizes=receive, input_split_sizes=send
        )
    )
    return out


class _Exchange(torch.autograd.Function):
    """_all_to_all forward; backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group, "expert tokens")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group, "expert token gradients"), None, None, None


def exchange(x: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
    """Differentiable variable-split all-to-all over `group` (see _all_to_all)."""
    return _Exchange.apply(x, send, receive, group)


@dataclass
class ExpertDispatch:
    """An Experts module's `dispatch` under EP: rows sorted by global expert in, their outputs out."""

    group: Any
    ep: int

    def __call__(self, rows: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
        local = experts.num_experts // self.ep
        mine = torch.tensor(counts, dtype=torch.int64)
        # Counts travel on the host (gloo) or the device of the rows (NCCL needs device tensors).
        device = rows.device if dist.get_backend(self.group) != "gloo" else torch.device("cpu")
        theirs = _all_to_all(
            mine.to(device), [local] * self.ep, [local] * self.ep, self.group, "expert counts"
        )
        # theirs[s, e]: rows EP rank s sends to local expert e.
        theirs = theirs.cpu().view(self.ep, local)
        send = mine.view(self.ep, local).sum(1).tolist()
        receive = theirs.sum(1).tolist()
        received = exchange(rows, send, receive, self.group)
        # Received rows come by source rank, then local expert: regroup them by local expert.
        expert_of = torch.arange(local).repeat(self.ep).repeat_interleave(theirs.flatten())
        by_expert = expert_of.argsort(stable=True).to(rows.device)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if received.shape[0]:
            out = experts.compute(received[by_expert], theirs.sum(0).tolist())
        else:
            # No row for any local expert: still a graph through the rows and the experts, so this rank's
            # backward runs the reverse exchanges its peers wait in, and the experts' (zero) gradients reach
            # their buckets in the same order on every rank of the expert-DP group.
            out = received + 0.0 * (gate_up.sum() + down.sum())
        back = out[by_expert.argsort()]
        return exchange(back, receive, send, self.group)


def _shard(param: nn.Parameter, start: int, count: int) -> nn.Parameter:
    """Experts [start, start + count) of a stacked expert tensor (meta or not), marked with their place."""
    total = param.shape[0]
    shard = nn.Parameter(param.detach()[start : start + count].clone(), requires_grad=param.requires_grad)
    shard.expert_slice = (start, total)
    return shard


def apply_ep(model: nn.Module, topo: Topology) -> nn.Module:
    """Keep this rank's experts of every MoE layer of `model` (a CausalLM, on meta or not) and route the
    rest through the EP group, in place. Nothing to do at parallel.ep=1."""
    if topo.ep == 1:
        return model
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        count = module.num_experts // topo.ep
        start = topo.ep_rank * count
        module.gate_up_proj = _shard(module.gate_up_proj, start, count)
        module.down_proj = _shard(module.down_proj, start, count)
        module.dispatch = ExpertDispatch(topo.ep_group, topo.ep)
    return model


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` is an EP shard of stacked experts (reduced over the expert-DP group)."""
    return hasattr(param, "expert_slice")
