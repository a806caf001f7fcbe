"""FSDP2's parameter all-gather and gradient reduce-scatter as point-to-point shard exchange, for gloo.

On gloo, all_gather_into_tensor and reduce_scatter_tensor cost 3-4x what sending one shard to each peer
does (llmtrain.parallel.comm.exchange_shards), and FSDP2 issues one of each per unit and step; ZeRO-1's flat
buffers already exchange shards instead. These are FSDP2's own hooks for that (``set_custom_all_gather``,
``set_custom_reduce_scatter``): FSDP2 keeps its buffers, padding, copy-in/out, divide factors and HSDP
all-reduce, only the transfer changes. NCCL keeps FSDP2's native collectives.

The reduce-scatter is synchronous: FSDP2 reads its output right after the call. The all-gather is
asynchronous when FSDP2 asks (``unshard(async_op=True)``): ZeRO-2 launches every unit's gather right after
the optimizer step and each unit's forward waits for its own (llmtrain.parallel.fsdp.gather_after_step),
so the transfers overlap the next forward as ZeRO-1's do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from llmtrain.parallel.comm import Pending, exchange_shards

# Tags set these transfers apart from other point-to-point traffic between the same ranks (ZeRO-1 uses
# 2 * bucket and 2 * bucket + 1) and one unit's gathers in flight from another's.
_FIRST_TAG = 2**30


def _group_ranks(group: dist.ProcessGroup) -> tuple[list[int], int]:
    """The group's global ranks in group order, and this rank's index in them."""
    return dist.get_process_group_ranks(group), group.rank()


class _Transfers(dist.distributed_c10d.Work):
    """Point-to-point transfers in flight as one torch Work: FSDP2 waits for an asynchronous all-gather
    only when it gets a Work (gloo's send/recv works have no future to combine them into one)."""

    def __init__(self, transfers: list[Pending]) -> None:
        super().__init__()
        self.transfers = transfers

    def wait(self, timeout: object = None) -> bool:
        for work in self.transfers:
            work.wait()  # recorded by the watchdog as a wait on this transfer
        return True


class _TaggedExchange:
    """What both FSDP2 hooks share: their unit's point-to-point tag, and plain buffers to exchange into."""

    def __init__(self, tag: int) -> None:
        self.tag = tag

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ExchangeAllGather(_TaggedExchange, AllGather):
    """FSDP2's all-gather of a unit's parameter shards: ``output_tensor`` holds every rank's shard in group
    order, this rank's already in place (FSDP2 copies it in there), the peers' received into theirs."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        ranks, index = _group_ranks(group)
        shard = output_tensor.narrow(0, index * input_tensor.numel(), input_tensor.numel())
        if shard.data_ptr() != input_tensor.data_ptr():
            shard.copy_(input_tensor)
        detail = "parameters, shard exchange"
        work = _Transfers(exchange_shards(output_tensor, ranks, index, group, self.tag, "fsdp", detail))
        if async_op:
            return work
        work.wait()
        return None


class ExchangeReduceScatter(_TaggedExchange, ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients: ``output_tensor`` is the sum (or mean, for AVG) over
    the group of every rank's shard at this rank's index of ``input_tensor``, added in group order."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"shard-exchange reduce-scatter sums or averages; FSDP2 asked for {op}")
        ranks, index = _group_ranks(group)
        received = [torch.empty_like(output_tensor) for _ in range(len(ranks) - 1)]
        for work in exchange_shards(
            input_tensor, ranks, index, group, self.tag, "fsdp", "gradients, shard exchange", received
        ):
            work.wait()
        mine = input_tensor.narrow(0, index * output_tensor.numel(), output_tensor.numel())
        parts = received[:index] + [mine] + received[index:]
        output_tensor.copy_(parts[0])
        for part in parts[1:]:
            output_tensor.add_(part)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(len(ranks))


def use_shard_exchange(module: FSDPModule, mesh: DeviceMesh, unit: int) -> bool:
    """Give ``module`` (FSDP unit number ``unit``, sharded over ``mesh``'s last dimension) the
    shard-exchange all-gather and reduce-scatter when that dimension's group runs on gloo and has peers;
    whether it did."""
    group = mesh.get_group(mesh.ndim - 1)
    if dist.get_backend(group) != "gloo" or group.size() == 1:
        return False
    module.set_custom_all_gather(ExchangeAllGather(_FIRST_TAG + 2 * unit))
    module.set_custom_reduce_scatter(ExchangeReduceScatter(_FIRST_TAG + 2 * unit + 1))
    return True
