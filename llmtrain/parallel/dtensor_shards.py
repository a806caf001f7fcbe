"""Where a rank's FSDP2 shard sits in its parameter: the local tensor of a DTensor and its flat position.

Kept apart from llmtrain.parallel.fsdp so that the tensor layouts (llmtrain.parallel.param_layout) and the
optimizers that read them (llmtrain.parallel.muon) need not import FSDP's optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage, so in-place updates reach the DTensor), or ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def shard_position(t: torch.Tensor) -> tuple[int | None, int]:
    """Where this rank's FSDP shard of ``t`` starts in the flattened (TP-local) tensor, and which replica
    (hybrid sharding) holds it; (None, 0) for a plain tensor. FSDP2 shards dim 0 as torch.chunk does:
    ceil(rows / shards) rows per rank, the last ones short or empty (padded in FSDP's own buffers)."""
    if not isinstance(t, DTensor):
        return None, 0
    mesh = t.device_mesh
    rows = t.shape[0]
    per_rank = -(-rows // mesh.size(mesh.ndim - 1))
    start_row = min(mesh.get_local_rank(mesh.ndim - 1) * per_rank, rows)
    replica = mesh.get_local_rank(0) if mesh.ndim == 2 else 0
    return start_row * (t.numel() // rows if rows else 0), replica
