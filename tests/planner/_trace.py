"""Records the torch.distributed traffic one rank issues: every collective and point-to-point send."""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from llmtrain.parallel import comm
from llmtrain.parallel.topology import Topology
from llmtrain.planner.cost.collectives import DIMS, Comm

_DIMS = DIMS
_TORCH_OPS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}
_COMM_ALIASES = {"_all_gather_single": "all_gather", "_reduce_scatter_single": "reduce_scatter"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Tracer:
    """Collectives (op, group, full-buffer bytes) and sends of this rank while `recording()` is active.

    Groups are named as llmtrain.planner.collectives names them: the parallel dimensions they span that have
    more than one rank ("tp", "dp", "tp+pp", ...), found by comparing rank sets with the topology's groups;
    the topology's EP and expert-DP groups "ep" and "edp".
    """

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.calls: list[Comm] = []
        self.enabled = True
        """Whether `recording()` records (False: patched but silent, e.g. during warm-up steps)."""
        self._names: dict[tuple[int, ...], str] = {}
        live = [d for d in _DIMS if topo.sizes[d] > 1]
        for n in range(1, len(live) + 1):
            for dims in itertools.combinations(live, n):
                ranks = tuple(dist.get_process_group_ranks(topo.group(*dims)))
                self._names.setdefault(ranks, "+".join(dims))
        self._world = "+".join(live)
        # The expert-parallel groups by identity: their ranks may also form a dimension's group (ep = dp).
        self._expert_groups = (
            {id(topo.ep_group): "ep", id(topo.expert_dp_group): "edp"} if topo.ep > 1 else {}
        )

    def _group(self, group: Any) -> str:
        if group is None or group is dist.group.WORLD:
            return self._world
        if id(group) in self._expert_groups:
            return self._expert_groups[id(group)]
        return self._names.get(tuple(dist.get_process_group_ranks(group)), f"ranks{group}")

    def _peer_dims(self, peer: int) -> str:
        """The dimensions in which global rank `peer` differs from this rank ("pp" for pipeline sends)."""
        t = self.topo
        return "+".join(d for d in _DIMS if (peer // t.strides[d]) % t.sizes[d] != t.coords[d])

    def _record(self, op: str, group: Any, nbytes: int) -> None:
        if self.enabled:
            self.calls.append(Comm(op, self._group(group), dist.get_world_size(group), nbytes))

    def _wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            # An all-to-all's input is what the rank sends (output and input differ under variable splits).
            nbytes = _nbytes(tensors[1]) if op == "all_to_all" else max(_nbytes(t) for t in tensors)
            self._record(op, kwargs.get("group"), nbytes)
            return fn(*args, **kwargs)

        return traced

    def _wrap_send(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                   group_dst: int | None = None) -> Any:  # fmt: skip
            peer = dst if dst is not None else dist.get_global_rank(group or dist.group.WORLD, group_dst)
            if self.enabled:
                self.calls.append(Comm("send", self._peer_dims(peer), 2, _nbytes(tensor)))
            return fn(tensor, dst, group, tag, group_dst=group_dst)

        return traced

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Patch torch.distributed's entry points (and llmtrain.parallel.comm's aliases of them)."""
        saved: list[tuple[Any, str, Any]] = []

        def patch(module: Any, name: str, new: Any) -> None:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, new)

        for name, op in _TORCH_OPS.items():
            if hasattr(dist, name):
                patch(dist, name, self._wrap(op, getattr(dist, name)))
        for name, op in _COMM_ALIASES.items():
            patch(comm, name, self._wrap(op, getattr(comm, name)))
        # Sends are recorded where every path ends (batch_isend_irecv calls each P2POp's op); P2POp checks
        # its op against distributed_c10d's own names, so both bindings get the same wrapper.
        for name in ("isend", "send"):
            wrapped = self._wrap_send(getattr(c10d, name))
            patch(dist, name, wrapped)
            patch(c10d, name, wrapped)
        try:
            yield
        finally:
            for module, name, old in reversed(saved):
                setattr(module, name, old)

    def counts(self) -> Counter[Comm]:
        """How often each (op, group, size, bytes) occurred."""
        return Counter(self.calls)
