"""How context parallelism splits each sequence over the cp ranks, and a rank's place in that split.

Layout. A sequence of S tokens is cut into 2*cp chunks of S/(2*cp); CP rank r holds chunks r and 2*cp-1-r,
in that order. Under a causal mask the early chunks attend to little and the late ones to much, so every
rank gets the same amount of work. Token ids, labels and position ids follow the split
(`ContextSplit.split_inputs`, called by CausalLM.forward and the first pipeline stage), so rotary and learned
positions see each token's original position. Every CP rank of a data-parallel replica reads the same
samples; the split is a view of them, made where the model takes its inputs.

Loss. Each rank's mean cross-entropy over its tokens is weighted by its share of the labelled tokens of the
micro-batch, and the shares are summed over the CP group in forward (identity in backward): every CP rank
holds the loss of the whole sequence, and the gradient of its own part. GradBuffers sums the parts over cp
while averaging over dp (the cp x dp group of llmtrain.parallel.topology).

Attention across the split is llmtrain.parallel.context_parallel's; MoE layers routing a rank's part of the
sequences read the split from here too (llmtrain.parallel.tensor_parallel.share_capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.parallel import comm


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) CP rank `rank` holds: r and its mirror 2*cp-1-r."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Original positions of the tokens CP rank `rank` holds of a sequence of `seq` tokens."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank `rank`'s two chunks of `x` along `dim` (a whole sequence), concatenated."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"a sequence of {x.shape[dim]} tokens does not split into 2 * cp = {2 * cp} equal chunks; "
            "make model.seq_length a multiple of 2 * parallel.cp"
        )
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim)


def merge_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's split_sequence, in rank order (the inverse of the split)."""
    cp = len(parts)
    halves = [p.chunk(2, dim) for p in parts]
    ordered = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(ordered, dim)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over `group`; backward: the gradient of this rank's own term (identity)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        total = x.clone()
        comm.all_reduce(total, group=group, detail="context-parallel loss")
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@dataclass(eq=False)
class ContextSplit:
    """This rank's place in the context-parallel split and the group attention and the loss talk over."""

    cp: int
    """Context-parallel degree."""
    rank: int
    """This rank's index in the CP group."""
    group: Any
    """The CP process group."""
    next_rank: int
    """Global rank K/V are sent to (the next CP rank on the ring)."""
    prev_rank: int
    """Global rank K/V are received from (the previous CP rank on the ring)."""
    comm: str = "ring"
    """ring or all_to_all (parallel.cp_comm)."""

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a whole sequence `x` along `dim`."""
        return split_sequence(x, self.cp, self.rank, dim)

    def whole(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequences from every CP rank's chunks `x` along `dim`, all-gathered (no gradient)."""
        return merge_sequence(list(comm.all_gather_dim(x, dim, self.group).chunk(self.cp, dim)), dim)

    def positions(self, local_seq: int, device: Any = None) -> torch.Tensor:
        """Original positions of this rank's `local_seq` tokens (of a sequence cp times as long)."""
        return local_positions(local_seq * self.cp, self.cp, self.rank, device)

    def split_inputs(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This rank's token ids (b, s/cp), labels and 1-D position ids (the original ones) of whole
        sequences (b, s); `position_ids` None means 0..s-1."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        local_labels = self.local(labels) if labels is not None else None
        return self.local(input_ids), local_labels, self.local(position_ids, dim=-1)

    def reduce_loss(self, loss: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The mean loss of the whole sequences from this rank's mean over its (local) `labels`: each rank's
        mean weighted by its share of the labelled tokens, summed over the CP group."""
        count = (labels != ignore_index).sum().to(torch.float32)
        total = count.clone()
        comm.all_reduce(total, group=self.group, detail="context-parallel label count")
        # A rank without labelled tokens has a NaN mean (0/0) and adds nothing.
        share = torch.where(count > 0, loss, 0.0) * (count / total)
        return _SumOverGroup.apply(share, self.group)
