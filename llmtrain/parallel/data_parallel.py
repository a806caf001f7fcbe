"""Data parallelism: parameters and fp32 gradients in flat buffers, reduced bucket by bucket during backward.

Every trainable parameter becomes a view into one flat parameter buffer (model dtype) and gets a `main_grad`
view into one flat fp32 gradient buffer, in reverse registration order (roughly the order backward produces
them). A post-accumulate-grad hook per parameter counts the parameters of its bucket; when the last one is in,
the bucket's reduction (all-reduce for zero_stage 0, reduce-scatter for zero_stage 1) starts asynchronously,
so communication overlaps the rest of backward. A parameter shared by two modules (tied embeddings) is one
tensor with one hook, so it is reduced once. Under expert parallelism the experts' shards sit in buckets of
their own, reduced over the expert-data-parallel group (the ranks holding the same experts) instead.

With parallel.dp_reduce=tree (zero_stage 0) a bucket is all-gathered instead and summed here in a fixed
balanced tree over the ranks in order, ((g0+g1)+(g2+g3))+...; floating-point addition is commutative, so
every rank gets the same bits. A rank's micro-batches are contiguous in the global batch and its buffer holds
g0, then g0+g1 (autograd adds into it), so with 1 or 2 micro-batches per rank and 2^k ranks the sum is the
one balanced tree over the global batch's micro-batches whatever the split: 4 ranks of 1 and 2 ranks of 2
give the same gradient bits (the loss divisors and the pre-division by dp are powers of two, exact scalings).
The native all-reduce sums in an order of the backend's choosing (gloo's ring starts each chunk at another
rank), which agrees only to rounding across ranks counts.

Under zero_stage 1 the optimizer step ends by launching every bucket's parameter all-gather asynchronously,
in forward order; with ``overlap_param_gather`` a forward pre-hook on each module waits only for the buckets
of its own parameters, so the gather overlaps the next forward (Megatron's overlap_param_gather). Anything
that reads parameters outside a forward goes through ``state_dict()``, whose pre-hooks wait likewise, or
calls ``wait_params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config.schema import JobConfig
from llmtrain.parallel.comm import (
    Pending,
    all_gather_single,
    all_reduce,
    exchange_shards,
    reduce_scatter_single,
)
from llmtrain.parallel.expert_parallel import is_expert
from llmtrain.parallel.param_layout import named_parameters_once
from llmtrain.parallel.topology import Topology
from llmtrain.precision import torch_dtype


@dataclass(frozen=True)
class ReduceGroup:
    """The ranks a bucket's gradients are reduced over (and ZeRO-1 shards its optimizer state over)."""

    group: Any
    ranks: list[int]
    """Global ranks of the group, in the group's rank order."""
    index: int
    """This rank's position in `ranks`: the shard it owns."""
    mean_over: int
    """The data-parallel degree: the reduced sum is divided by it (the loss is a mean over DP ranks)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def reduce_groups(topo: Topology) -> tuple[ReduceGroup, ReduceGroup]:
    """(dense, expert) ReduceGroups: context-parallel ranks hold the same parameters as DP replicas, each the
    gradient of its part of the sequences' loss, so dense gradients are summed over cp x dp and averaged
    over dp; an EP rank's expert gradients already sum every EP rank's tokens, so they are summed over the
    expert-data-parallel group and divided by dp as well (llmtrain.parallel.expert_parallel)."""
    dense = ReduceGroup(topo.dp_cp_group, topo.dp_cp_ranks(), topo.dp_cp_rank, topo.dp)
    if topo.ep == 1:
        return dense, dense
    return dense, ReduceGroup(topo.expert_dp_group, topo.expert_dp_ranks(), topo.expert_dp_rank, topo.dp)


@dataclass(eq=False)
class Bucket:
    """A contiguous range [start, end) of the flat buffers whose reduction is launched as one collective."""

    index: int
    start: int
    end: int
    params: list[nn.Parameter]
    reduce: ReduceGroup
    pending: int = 0
    handle: list[Pending] | None = None
    launched: bool = False
    gather_handle: list[Pending] | None = None
    received: list[torch.Tensor] | None = None
    gathered: torch.Tensor | None = None
    """dp_reduce=tree: every rank's copy of the bucket, rank after rank, until finish sums them."""

    @property
    def shard_size(self) -> int:
        return (self.end - self.start) // self.reduce.size

    @property
    def shard_start(self) -> int:
        """Where this rank's ZeRO-1 shard of the bucket starts in the flat buffers."""
        return self.start + self.reduce.index * self.shard_size


class GradBuffers:
    """Flat parameter/gradient storage of one model (or pipeline stage) and its bucketed DP reduction."""

    def __init__(
        self,
        model: nn.Module,
        topo: Topology,
        precision: str,
        zero_stage: int,
        bucket_mb: float,
        overlap_param_gather: bool = True,
        dp_reduce: str = "all_reduce",
    ) -> None:
        self.dtype = torch_dtype(precision)
        self.topo = topo
        self.dense, self.expert = reduce_groups(topo)
        self.zero_stage = zero_stage
        self.tree = dp_reduce == "tree"
        # On gloo zero_stage 1 reduce-scatters and gathers by point-to-point shard exchange, 3-4x faster
        # than gloo's collectives (llmtrain.parallel.comm.exchange_shards). NCCL uses the native ones.
        self.native_shard_comm = self.dense.size > 1 and dist.get_backend(self.dense.group) != "gloo"
        self.sync_enabled = True
        names = {id(p): name for name, p in named_parameters_once(model)}
        seen: set[int] = set()
        params = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        params.reverse()
        self.names = {p: names[id(p)] for p in params}
        bucket_numel = max(1, int(bucket_mb * 2**20 / 4))
        # Layout: fill buckets in backward order; pad each bucket to a multiple of dp so it splits evenly.
        # A pipeline's tied embedding gets a bucket of its own, so its DP shards cover the same elements on
        # the first and the last stage and summing the two copies' reduced shards is exact. Expert and
        # dense parameters never share a bucket: they are reduced over different groups.
        alone = getattr(model, "tied_param", None)
        self.offsets: dict[nn.Parameter, int] = {}
        self.buckets: list[Bucket] = []
        offset, current = 0, []
        bucket_start = 0

        def group_of(p: nn.Parameter) -> ReduceGroup:
            return self.expert if is_expert(p) else self.dense

        def close_bucket() -> None:
            nonlocal offset, bucket_start, current
            reduce = group_of(current[0])
            end = bucket_start + -(-(offset - bucket_start) // reduce.size) * reduce.size
            self.buckets.append(Bucket(len(self.buckets), bucket_start, end, current, reduce))
            offset = bucket_start = end
            current = []

        for p in params:
            if current and (p is alone or group_of(p) is not group_of(current[0])):
                close_bucket()
            self.offsets[p] = offset
            offset += p.numel()
            current.append(p)
            if offset - bucket_start >= bucket_numel or p is alone:
                close_bucket()
        if current:
            close_bucket()
        self.numel = offset
        device = params[0].device if params else torch.device("cpu")
        self.param_buffer = torch.zeros(self.numel, dtype=self.dtype, device=device)
        self.grad_buffer = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # Exact fp32 initial values, kept until the optimizer builds its fp32 master copy from them.
        self.fp32_init: torch.Tensor | None = None
        if self.dtype != torch.float32:
            self.fp32_init = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of[p] = bucket
                view = self._view(self.param_buffer, p)
                view.copy_(p.data)
                if self.fp32_init is not None:
                    self._view(self.fp32_init, p).copy_(p.data)
                p.data = view
                p.main_grad = self._view(self.grad_buffer, p)
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.params = params
        sharded = zero_stage == 1 and any(b.reduce.size > 1 for b in self.buckets)
        self.overlap_param_gather = overlap_param_gather and sharded
        if sharded:
            for module in model.modules():
                own: list[Bucket] = []  # the buckets holding this module's own parameters
                for p in module.parameters(recurse=False):
                    if p in self.bucket_of and self.bucket_of[p] not in own:
                        own.append(self.bucket_of[p])
                if own:
                    if self.overlap_param_gather:
                        module.register_forward_pre_hook(lambda *_, own=own: self._wait_gathers(own))
                    module.register_state_dict_pre_hook(lambda *_, own=own: self._wait_gathers(own))
        self.zero_grad()

    def _view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        start = self.offsets[p]
        return flat[start : start + p.numel()].view(p.shape)

    def zero_grad(self) -> None:
        """Zero the fp32 gradients and re-arm every bucket."""
        self.finish(launch=False)
        self.grad_buffer.zero_()
        for p in self.params:
            # fp32 parameters accumulate straight into the buffer (autograd adds in place into .grad).
            p.grad = p.main_grad if self.dtype == torch.float32 else None
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.dtype != torch.float32:
            # Low-precision gradient of this micro-batch, accumulated in fp32.
            p.main_grad.add_(p.grad)
            p.grad = None
        if not self.sync_enabled:
            return
        bucket = self.bucket_of[p]
        if bucket.launched:
            raise RuntimeError(
                f"gradient of {self.names[p]} arrived after its bucket was reduced: wrap "
                "gradient-accumulation micro-steps except the last in "
                "llmtrain.parallel.grad_sync(model, False)"
            )
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        reduce = bucket.reduce
        grad = self.grad_buffer[bucket.start : bucket.end]
        if reduce.size == 1:
            if reduce.mean_over > 1:  # experts held by one rank of several DP ranks: only the mean's divide
                grad.div_(reduce.mean_over)
            return
        detail = f"gradients of bucket {bucket.index}"
        if self.zero_stage == 1 and not self.native_shard_comm:
            bucket.received = [torch.empty_like(self.shard(grad, bucket)) for _ in range(reduce.size - 1)]
            bucket.handle = self._exchange_shards(grad, bucket, 2 * bucket.index + 1, bucket.received)
            return
        # Pre-divide so the sum is the mean over DP ranks (gloo has no AVG); CP ranks' parts add up.
        grad.div_(reduce.mean_over)
        if self.zero_stage == 1:
            shard = self.shard(grad, bucket)
            bucket.handle = [
                reduce_scatter_single(shard, grad, group=reduce.group, async_op=True, detail=detail)
            ]
        elif self.tree:
            bucket.gathered = torch.empty(reduce.size * grad.numel(), dtype=grad.dtype, device=grad.device)
            bucket.handle = [
                all_gather_single(bucket.gathered, grad, group=reduce.group, async_op=True, detail=detail)
            ]
        else:
            bucket.handle = [all_reduce(grad, group=reduce.group, async_op=True, detail=detail)]

    def shard(self, flat_bucket: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of a bucket-sized tensor (its ZeRO-1 shard)."""
        size = bucket.shard_size
        return flat_bucket[bucket.reduce.index * size : (bucket.reduce.index + 1) * size]

    def finish(self, launch: bool = True) -> None:
        """Launch the buckets still waiting (unused parameters) and wait for every reduction."""
        for bucket in self.buckets:
            if launch and not bucket.launched:
                self._launch(bucket)
            if bucket.handle is not None:
                for work in bucket.handle:
                    work.wait()  # recorded by the watchdog as a wait on this numbered collective
                bucket.handle = None
            if bucket.gathered is not None:
                rows = bucket.gathered.view(bucket.reduce.size, -1)
                self.grad_buffer[bucket.start : bucket.end].copy_(pairwise_sum(rows))
                bucket.gathered = None
            if bucket.received is not None:
                # Reduce-scatter by exchange: the peers' copies of this rank's shard, summed into it.
                shard = self.shard(self.grad_buffer[bucket.start : bucket.end], bucket)
                for theirs in bucket.received:
                    shard.add_(theirs)
                shard.div_(bucket.reduce.mean_over)
                bucket.received = None

    def all_gather_params(self) -> None:
        """After a zero_stage-1 update of this rank's shards, give every DP rank the full parameters: the
        gathers are launched here, last bucket (first layers) first, and waited for by the forward of the
        modules that use them, or right away without ``overlap_param_gather``."""
        for bucket in reversed(self.buckets):
            if bucket.reduce.size == 1:
                continue
            flat = self.param_buffer[bucket.start : bucket.end]
            shard = self.shard(flat, bucket)
            if self.native_shard_comm:
                bucket.gather_handle = [
                    all_gather_single(
                        flat,
                        shard,
                        group=bucket.reduce.group,
                        async_op=True,
                        detail=f"parameters of bucket {bucket.index}",
                    )
                ]
            else:
                bucket.gather_handle = self._exchange_shards(flat, bucket, 2 * bucket.index)
        if not self.overlap_param_gather:
            self.wait_params()

    def _exchange_shards(
        self, flat: torch.Tensor, bucket: Bucket, tag: int, into: list[torch.Tensor] | None = None
    ) -> list[Pending]:
        """llmtrain.parallel.comm.exchange_shards of a bucket-sized ``flat`` over the bucket's group."""
        reduce = bucket.reduce
        what = "parameters" if into is None else "gradients"
        return exchange_shards(
            flat,
            reduce.ranks,
            reduce.index,
            reduce.group,
            tag,
            "expert-dp" if reduce is not self.dense else "dp",
            f"{what} of bucket {bucket.index}, shard exchange",
            into,
        )

    def _wait_gathers(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if bucket.gather_handle is not None:
                for work in bucket.gather_handle:
                    work.wait()  # recorded by the watchdog as a wait on this transfer
                bucket.gather_handle = None

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight (zero_stage 1): the parameters are whole."""
        self._wait_gathers(self.buckets[::-1])

    def local_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, buffer start, buffer end) pieces of the parameters this rank updates, in buffer order."""
        pieces = []
        for bucket in self.buckets:
            if self.zero_stage == 0:
                lo, hi = bucket.start, bucket.end
            else:
                lo = bucket.shard_start
                hi = lo + bucket.shard_size
            for p in bucket.params:
                start, end = self.offsets[p], self.offsets[p] + p.numel()
                if max(start, lo) < min(end, hi):
                    pieces.append((p, max(start, lo), min(end, hi)))
        return pieces


def pairwise_sum(rows: torch.Tensor) -> torch.Tensor:
    """The sum of rows[0], rows[1], ... in a balanced tree, neighbours first: ((r0+r1)+(r2+r3))+...; an odd
    last row joins at the next level."""
    while len(rows) > 1:
        even = len(rows) // 2 * 2
        summed = rows[0:even:2] + rows[1:even:2]
        rows = torch.cat([summed, rows[even:]]) if even < len(rows) else summed
    return rows[0]


def apply_dp(
    model: nn.Module,
    topo: Topology,
    precision: str = "fp32",
    zero_stage: int = 0,
    bucket_mb: float = 25.0,
    overlap_param_gather: bool = True,
    dp_reduce: str = "all_reduce",
) -> nn.Module:
    """Move the parameters into flat buffers (cast to the compute dtype) and install the bucketed DP hooks."""
    if getattr(model, "grad_buffers", None) is not None:
        raise RuntimeError("apply_dp was already applied to this model")
    model.grad_buffers = GradBuffers(
        model, topo, precision, zero_stage, bucket_mb, overlap_param_gather, dp_reduce
    )
    return model


def dp_options(job: JobConfig) -> dict[str, Any]:
    """apply_dp's keyword arguments for this job (zero_stage 0/1)."""
    p = job.parallel
    return {
        "precision": job.train.precision,
        "zero_stage": p.zero_stage,
        "bucket_mb": p.dp_bucket_mb,
        "overlap_param_gather": p.overlap_param_gather,
        "dp_reduce": p.dp_reduce,
    }
