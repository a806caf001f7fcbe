"""The input embedding and the output layer + loss of a ZeRO-2/3 model computed where FSDP keeps their shards.

FSDP2 shards a weight by rows; for the token table and the output layer a row is a vocabulary id, so rank r
of the shard group holds ids [r*V/n, (r+1)*V/n). Gathering either whole vocabulary-sized matrix for its
unit's forward and backward, beside its whole gradient and FSDP's reduce-scatter copy of that gradient,
was the largest transient of a ZeRO-3 step: three (vocab x hidden) fp32 matrices at the backward's start
and again at its end. Instead the ranks exchange tokens, which are few next to a vocabulary (tokens x
hidden against vocab x hidden), and each uses only its own rows (llmtrain.config.vocab_sharding says
when):

- embedding: the group's token ids are all-gathered; each rank looks up the ids in its slice (zeros for
  the others) for every token of the group, and a reduce-scatter sums them into each rank's own tokens.
- output layer: the group's final hidden states are all-gathered; each rank computes the logits of every
  token of the group for its own ids, and the vocabulary-parallel cross-entropy (kernels.cross_entropy
  over the group, as under tensor parallelism) combines the ranks' partial softmax sums into the loss L,
  the mean over the group's labelled tokens, the same on every rank.

Gradients: every rank backprops the same L. Its rows of the output layer get dL/dW_r from all the group's
tokens, which is already the reduced gradient of its shard: FSDP does not touch it. The hidden states'
gradient is reduce-scattered (summed) back to each rank's tokens and multiplied by n, because FSDP
averages the blocks' gradients over the n ranks and so must be handed n times each rank's part of dL/dθ.
The embedding's reduce-scatter passes that gradient back all-gathered, so a rank's token rows receive
the sum over the group of n times their share: divided by n they are dL/dW_r, again the reduced shard.

The loss each rank returns is L, whose mean over the ranks (the trainer's) is L too. FSDP's averaging
of per-rank means weighted each rank's labelled tokens by 1 / (n * its count); L weights every labelled
token of the group alike. The two agree whenever the ranks have equally many labelled tokens (a packed
batch without masked labels) and otherwise L is the exact mean over the group's tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import kernels
from llmtrain.parallel.tensor_parallel import gather_sequence, reduce_scatter_sequence


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `factor`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class VocabShardedEdges:
    """Embedding lookups and the loss over this rank's vocabulary rows of FSDP-sharded weights (module
    docstring). ``group``: the shard group (its rank order is the shards' order); ``dtype``: the compute
    dtype FSDP's mixed precision would have cast the gathered weights to (None: the weights' own)."""

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype | None, impl: str) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype = dtype
        self.impl = impl

    def _rows(self, weight: torch.Tensor, grad_factor: float) -> tuple[torch.Tensor, int]:
        """This rank's rows of the sharded ``weight`` (differentiable: the gradient lands on the DTensor
        parameter's shard, times ``grad_factor``), in the compute dtype, and the first vocabulary id."""
        local = weight.to_local()
        rows = local.shape[0]
        if rows * self.size != weight.shape[0] or weight.device_mesh.get_local_rank() != self.rank:
            raise RuntimeError(
                f"the vocabulary-sharded embedding/output layer needs equal row shards in the group's rank "
                f"order; got {rows} of {weight.shape[0]} rows at mesh coordinate "
                f"{weight.device_mesh.get_local_rank()} on group rank {self.rank}"
            )
        local = _ScaleGrad.apply(local, grad_factor)
        return (local if self.dtype is None else local.to(self.dtype)), self.rank * rows

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The (b, s, hidden) embeddings of this rank's (b, s) token ids, from the table's row shards."""
        # 1/n: each rank's rows receive the gradients of the whole group, each n times its share.
        local, first = self._rows(weight, 1.0 / self.size)
        ids = gather_sequence(input_ids, self.group, dim=0) - first
        inside = (ids >= 0) & (ids < local.shape[0])
        rows = F.embedding(torch.where(inside, ids, 0), local) * inside.unsqueeze(-1).to(local.dtype)
        return reduce_scatter_sequence(rows, self.group, dim=0)

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over the group's labelled tokens of the output layer (``weight``'s
        row shards) applied to this rank's final (b, s, hidden) states with their (b, s) labels."""
        local, _ = self._rows(weight, 1.0)
        gathered = gather_sequence(_ScaleGrad.apply(hidden, float(self.size)), self.group, dim=0)
        logits = F.linear(gathered, local)
        targets = gather_sequence(labels, self.group, dim=0)
        return kernels.cross_entropy(logits, targets, tp_group=self.group, impl=self.impl)
