"""A mixture of experts' router losses and figures across pipeline stages.

The load-balancing loss pools every MoE layer's statistics before its product: num_experts * sum_e f_e P_e,
f (token shares, no gradient) and P (mean probabilities) summed over all MoE layers of a micro-batch. A
stage holds only some layers, and the gradient of a layer's probability sums, num_experts * f_e / rows, needs
the other stages' token counts. The exact pooled form fits every schedule as follows. Once a rank has run
the forward of micro-batch m on all its chunks, it starts an asynchronous all-reduce over the pp group of
one vector of m's statistics (its layers' loads in a (MoE layers, experts) table, zeros elsewhere; the
balance counts, detached probability sums, z sums, dropped counts and rows of its layers). Each chunk runs
its forwards in micro-batch order, so every rank starts these all-reduces in the same order under 1f1b,
interleaved, zero-bubble and gpipe alike. The backward of m on any stage runs after every stage's forward
of m (its gradient comes from the last stage, whose forward needs all the earlier ones), so after every
rank has started m's all-reduce: waiting for it in the backward cannot deadlock. The gradient enters at the
chunk's output through _RouterGrad (identity for the activations or the loss): coef * num_experts * f_e /
rows for each of the chunk's layers' probability sums and z_coef / rows for its z sums, times the step's
loss scale over the micro-batches. The z-loss is separable over layers; the pooled table gives every rank
each layer's load, for the figures the trainer logs and for the score-bias update of its own layers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmtrain.models.moe import RouterFigures
from llmtrain.parallel import comm
from llmtrain.parallel.topology import Topology


class _RouterGrad(torch.autograd.Function):
    """Identity on `out`; in backward, `grad_of()` gives the router terms' gradient of the chunk's stacked
    probability sums (layers, experts) and z sums (layers,)."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, prob_sums: torch.Tensor, z_sums: torch.Tensor, grad_of: Any
    ) -> Any:
        ctx.grad_of = grad_of
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        prob_grad, z_grad = ctx.grad_of()
        return grad, prob_grad, z_grad, None


class PipelineRouter:
    """One executor's router bookkeeping for a step: `start`, `after_forward` per F action, `finish`."""

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology) -> None:
        self.chunks = list(chunks)
        cfg = self.chunks[0].shell.config
        self.cfg = cfg
        self.topo = topo
        self.layers = self.chunks[0].num_moe_layers
        self.experts = cfg.num_experts
        self.coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.start(1.0)

    def start(self, scale: float) -> None:
        """A new step whose losses' gradients are scaled by `scale` (loss scale / micro-batches)."""
        self.scale = scale
        self.vectors: dict[int, torch.Tensor] = {}
        self.forwards: dict[int, int] = {}
        self.pending: dict[int, Any] = {}

    def after_forward(self, chunk: nn.Module, microbatch: int, out: torch.Tensor) -> torch.Tensor:
        """Record `chunk`'s MoE statistics of `microbatch`; `out` with the router terms' gradient attached."""
        rows, stats = chunk.router_rows, chunk.router_stats()
        e, n = self.experts, self.layers
        if microbatch not in self.vectors:
            self.vectors[microbatch] = torch.zeros(n * e + 2 * e + 3, device=out.device)
        vec = self.vectors[microbatch]
        table, bal, prob, rest = (
            vec[: n * e].view(n, e),
            vec[n * e : n * e + e],
            vec[n * e + e : -3],
            vec[-3:],
        )
        with torch.no_grad():
            for row, s in zip(rows, stats, strict=True):
                table[row] += s.tokens_per_expert
                bal += s.balance_tokens
                prob += s.prob_sum
                rest += torch.stack([s.z_sum, s.dropped, s.z_sum.new_tensor(float(s.rows))])
        self.forwards[microbatch] = self.forwards.get(microbatch, 0) + 1
        if self.forwards[microbatch] == len(self.chunks) and self.topo.pp > 1:
            self.pending[microbatch] = comm.all_reduce(
                vec, group=self.topo.pp_group, async_op=True, detail=f"router statistics mb={microbatch}"
            )
        if not stats or (self.coef == 0 and self.z_coef == 0):
            return out
        prob_sums = torch.stack([s.prob_sum for s in stats])
        z_sums = torch.stack([s.z_sum for s in stats])
        grad_of = functools.partial(self._grads, microbatch, len(stats))
        return _RouterGrad.apply(out, prob_sums, z_sums, grad_of)

    def _pooled(self, microbatch: int) -> torch.Tensor:
        """The statistics of `microbatch` summed over the pipeline stages."""
        pending = self.pending.pop(microbatch, None)
        if pending is not None:
            pending.wait()
        return self.vectors[microbatch]

    def _grads(self, microbatch: int, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        vec = self._pooled(microbatch)
        e, n = self.experts, self.layers
        rows = vec[-1]
        share = vec[n * e : n * e + e] / rows  # f: pooled over every MoE layer of the model
        prob_grad = (self.coef * self.scale * e / rows) * share
        z_grad = (self.z_coef * self.scale / rows).expand(layers)
        return prob_grad.expand(layers, e), z_grad

    def finish(self, num_microbatches: int) -> tuple[torch.Tensor, RouterFigures]:
        """The mean over micro-batches of the router terms of the training loss, and the step's figures."""
        e, n = self.experts, self.layers
        figures, terms = [], []
        for m in range(num_microbatches):
            vec = self._pooled(m)
            rows = vec[-1]
            aux = e * (vec[n * e : n * e + e] / rows * vec[n * e + e : -3] / rows).sum()
            z, dropped = vec[-3] / rows, vec[-2] / (self.cfg.num_experts_per_tok * rows)
            figures.append(RouterFigures(aux, z, dropped, vec[: n * e].view(n, e)))
            terms.append(self.coef * aux + self.z_coef * z)
        return torch.stack(terms).mean(), RouterFigures.combine(figures)
