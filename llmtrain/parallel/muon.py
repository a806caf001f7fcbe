"""Muon (momentum orthogonalised by Newton-Schulz) for the hidden matrices, AdamW for the rest, on any layout.

Which parameters Muon updates (`muon_updates`): every 2-D matrix of the blocks (attention, MLP, shared
experts, MLA's projections) and every routed expert's matrix (a stacked (experts, rows, cols) tensor is
orthogonalised expert by expert); a fused SwiGLU `gate_up_proj` is orthogonalised as its two matrices, gate
and up, each alone and with its own shape's learning-rate adjustment (`fused_parts`), as the recipes' separate
w1 and w3 are (one [2 ffn, hidden] matrix would be another update, and its larger shape would scale the
learning rate by up to sqrt(2) under either adjustment). AdamW keeps the token and position embeddings, the
output layer, norms, biases and the router, as Keller Jordan's and Moonlight's recipes do. Any other shape
is refused.

The update is torch.optim.Muon's (torch 2.13), step for step: momentum ``buf.lerp_(g, 1 - mu)``, the
Nesterov look-ahead ``g.lerp(buf, mu)``, torch's own Newton-Schulz iteration (`_zeropower_via_newtonschulz`,
in bf16, as torch runs it) and learning-rate adjustment (`_adjust_lr`), then decoupled weight decay and the
step. On one process with whole matrices it is torch.optim.Muon's arithmetic on the same tensors
(tests/parallel/test_muon.py compares bitwise).

Sharded layouts. The momentum buffer is elementwise, so it lives, sharded, exactly where AdamW's moments
would: beside this rank's fp32 master pieces (zero_stage 0/1 flat ranges, TP slices, expert slices) or its
FSDP2 shard (zero_stage 2/3); checkpoints save and reshard it as ``optim.<name>.momentum_buffer`` like
AdamW's ``exp_avg``. The orthogonalisation needs each whole matrix: every rank writes the pieces of the
look-ahead update it is the writer of (each element of the stage's matrices has one writer: the first DP
replica, the TP rank that is not a replica) into a zeroed buffer of the pipeline stage's Muon matrices at
their single-process shapes, one all-reduce over the stage's tp x cp x dp ranks makes the buffer whole on
every rank, and each rank orthogonalises only the matrices (the experts) it holds a piece of and keeps its
pieces of the result. Under ZeRO-1 that spreads the Newton-Schulz work over the DP ranks (each owns about
1/dp of the matrices); under TP and ZeRO-3 every holder of a piece computes the matrix. The extra
communication is that all-reduce: 2 (n - 1) / n times the stage's Muon matrices in fp32 per step, n the
stage's tp x cp x dp ranks (llmtrain.planner.cost.step_collectives prices it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim._muon import EPS, _adjust_lr, _zeropower_via_newtonschulz

from llmtrain.config.schema import JobConfig
from llmtrain.errors import UserError
from llmtrain.parallel import comm
from llmtrain.parallel.dtensor_shards import local_tensor, shard_position
from llmtrain.parallel.param_layout import ModelTensor, Piece, tp_layout
from llmtrain.parallel.topology import Topology

ADAMW_PARTS = ("embed_tokens.", "embed_positions.", "lm_head.", "router.")
"""Name parts of the 2-D parameters AdamW keeps under train.optimizer=muon (embeddings, head, router)."""


def muon_updates(name: str, shape: Sequence[int]) -> bool:
    """Whether Muon updates the parameter `name` of (single-process) `shape`; see the module docstring.
    Raises UserError for a matrix-like parameter Muon cannot orthogonalise."""
    if len(shape) < 2 or any(f".{part}" in f".{name}" for part in ADAMW_PARTS):
        return False
    if len(shape) == 2 or (len(shape) == 3 and ".experts." in f".{name}"):
        if 0 in shape:
            raise UserError(
                f"train.optimizer=muon cannot orthogonalise {name}, an empty matrix of shape {tuple(shape)}; "
                "fix the model's sizes or set train.optimizer=adamw"
            )
        return True
    raise UserError(
        f"train.optimizer=muon orthogonalises 2-D matrices (and per-expert stacks), not {name} of shape "
        f"{tuple(shape)}; set train.optimizer=adamw for this model"
    )


FUSED_PARTS = {"gate_up_proj": 2}
"""Parameters (by module name) that fuse several matrices along their rows: how many, each orthogonalised
alone (SwiGLU's gate and up: llmtrain.models.layers and the MoE experts)."""


def fused_parts(name: str) -> int:
    """Into how many row blocks of equal size Muon splits the parameter `name` before orthogonalising."""
    return next((n for part, n in FUSED_PARTS.items() if f".{part}" in f".{name}"), 1)


@dataclass(eq=False)
class MuonMatrix:
    """One Muon parameter of the pipeline stage and this rank's part of it."""

    name: str
    global_shape: tuple[int, ...]
    offset: int
    """Where the whole tensor starts in the stage's assembly buffer (the same on every rank)."""
    key: torch.Tensor | None = None
    """The tensor this rank updates (an fp32 master piece or an FSDP2 shard); None: it holds no part."""
    pieces: Callable[[torch.Tensor], list[Piece]] | None = None
    """This rank's pieces (views with their offsets in the whole tensor) of a tensor shaped like `key`."""
    write: bool = False
    """Whether this rank writes its pieces into the whole matrix (one writer per element)."""
    parts: int = 1
    """Row blocks orthogonalised apart (fused_parts)."""

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)


def muon_group(params: list[torch.Tensor], job: JobConfig) -> dict[str, Any]:
    """torch.optim.Muon's param-group hyperparameters from the config, over `params`."""
    t = job.train
    return {
        "params": params,
        "muon": True,
        "lr": t.muon_lr or t.lr,
        "lr_scale": (t.muon_lr or t.lr) / t.lr,
        "weight_decay": t.weight_decay if t.muon_weight_decay is None else t.muon_weight_decay,
        "momentum": t.muon_momentum,
        "nesterov": t.muon_nesterov,
        "ns_coefficients": tuple(t.muon_ns_coefficients),
        "eps": EPS,
        "ns_steps": t.muon_ns_steps,
        "adjust_lr_fn": t.muon_adjust_lr,
    }


def flat_matrices(buffers: Any, masters: list[torch.Tensor], topo: Topology) -> list[MuonMatrix]:
    """The stage's Muon matrices over the flat buffers of llmtrain.parallel.data_parallel.GradBuffers
    (zero_stage 0/1): keys are this rank's fp32 master pieces (`masters`, in `buffers.local_ranges()`
    order), written by the first DP replica (zero_stage 0) or by their only owner (zero_stage 1)."""
    held = {p: (master, start) for master, (p, start, _) in zip(masters, buffers.local_ranges(), strict=True)}
    matrices, offset = [], 0
    for p in buffers.params:
        name = buffers.names[p]
        layout = tp_layout(name, p, topo.tp, topo.tp_rank)
        if not muon_updates(name, layout.global_shape):
            continue
        m = MuonMatrix(name, layout.global_shape, offset, parts=fused_parts(name))
        offset += m.numel
        if p in held:
            m.key, start = held[p]
            m.pieces = lambda t, layout=layout, at=start - buffers.offsets[p]: layout.flat_pieces(t, at)
            m.write = layout.writer and (buffers.zero_stage == 1 or buffers.bucket_of[p].reduce.index == 0)
        matrices.append(m)
    return matrices


def fsdp_matrices(named: list[tuple[str, torch.Tensor]], topo: Topology) -> list[MuonMatrix]:
    """The stage's Muon matrices among FSDP2-sharded parameters (zero_stage 2/3): keys are the parameters
    (DTensors), written by the first replica of the shards (hybrid sharding)."""
    matrices, offset = [], 0
    for name, p in named:
        layout = tp_layout(name, p, topo.tp, topo.tp_rank)  # a DTensor's shape is the TP-local one
        if not p.requires_grad or not muon_updates(name, layout.global_shape):
            continue
        start, replica = shard_position(p)
        shard = ModelTensor(p, layout, start, replica)
        matrices.append(
            MuonMatrix(
                name,
                layout.global_shape,
                offset,
                p,
                shard.pieces,
                layout.writer and replica == 0,
                fused_parts(name),
            )
        )
        offset += matrices[-1].numel
    return matrices


def stage_group(topo: Topology) -> tuple[Any, int]:
    """The ranks holding parts of this pipeline stage's matrices (tp x cp x dp) and how many there are.
    Every rank must call it at the same point (it may create the group)."""
    size = topo.tp * topo.cp * topo.dp
    return (topo.group("tp", "cp", "dp") if size > 1 else None), size


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (as built for train.optimizer=adamw) over the AdamW parameters and Muon over the
    `matrices` of the stage, as one torch optimizer: one ``param_groups`` list (AdamW's groups, then Muon's)
    and one ``state``, which the inner AdamW shares, so checkpoints and ``state_dict`` see every parameter's
    state as for AdamW alone."""

    def __init__(
        self,
        adamw: torch.optim.Optimizer | None,
        matrices: list[MuonMatrix],
        job: JobConfig,
        group: Any,
        group_size: int,
        device: torch.device,
    ) -> None:
        self.adamw = adamw
        self.matrices = matrices
        self.numel = sum(m.numel for m in matrices)
        self.comm_group, self.comm_size = group, group_size
        self.device = device
        held = [m.key for m in matrices if m.key is not None]
        groups = [*(adamw.param_groups if adamw is not None else []), muon_group(held, job)]
        super().__init__(groups, {})
        self._link()

    def _link(self) -> None:
        """Point the inner AdamW at this optimizer's state and its own groups (after a load replaced them)."""
        if self.adamw is not None:
            self.adamw.state = self.state
            self.adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def comm_bytes(self) -> int:
        """Bytes this rank sends and receives in one step's all-reduce of the whole matrices (ring)."""
        n = self.comm_size
        return 0 if n == 1 else int(2 * (n - 1) / n * self.numel * 4)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        if self.adamw is not None:
            self.adamw.step()
        self._muon_step(next(g for g in self.param_groups if g.get("muon")))

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu = group["lr"], group["momentum"]
        whole = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        updates: list[tuple[MuonMatrix, torch.Tensor]] = []
        for m in self.matrices:
            if m.key is None or m.key.grad is None:
                continue
            grad = local_tensor(m.key.grad)
            state = self.state[m.key]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(m.key)
            buf = local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            updates.append((m, update))
            if m.write:
                matrix = self._whole(whole, m)
                for piece in m.pieces(update):
                    matrix[_rect(piece)].copy_(piece.tensor)
        if self.comm_size > 1:
            comm.all_reduce(whole, group=self.comm_group, detail="Muon's whole matrices")

        def orthogonal(x: torch.Tensor, parts: int) -> torch.Tensor:
            args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            if parts == 1:
                return _zeropower_via_newtonschulz(x, *args)
            return torch.cat([_zeropower_via_newtonschulz(block, *args) for block in x.chunk(parts)])

        for m, update in updates:
            matrix = self._whole(whole, m)
            out = torch.empty_like(update)
            pieces = m.pieces(out)
            if matrix.ndim == 2:
                result = orthogonal(matrix, m.parts)
                for piece in pieces:
                    piece.tensor.copy_(result[_rect(piece)])
            else:  # routed experts: each expert's matrix alone, only the experts this rank holds rows of
                done: dict[int, torch.Tensor] = {}
                for piece in pieces:
                    first, count = piece.offsets[0], piece.tensor.shape[0]
                    for e in range(first, first + count):
                        if e not in done:
                            done[e] = orthogonal(matrix[e], m.parts)
                        piece.tensor[e - first].copy_(done[e][_rect(piece, skip=1)])
            rows, cols = m.global_shape[-2:]
            param = local_tensor(m.key)
            param.mul_(1 - lr * group["weight_decay"])
            adjusted = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size((rows // m.parts, cols)))
            param.add_(out, alpha=-adjusted)

    @staticmethod
    def _whole(flat: torch.Tensor, m: MuonMatrix) -> torch.Tensor:
        return flat[m.offset : m.offset + m.numel].view(m.global_shape)


def _rect(piece: Piece, skip: int = 0) -> tuple[slice, ...]:
    """The slices of the whole tensor a piece covers (from dim `skip` on)."""
    return tuple(
        slice(o, o + s) for o, s in zip(piece.offsets[skip:], piece.tensor.shape[skip:], strict=True)
    )
