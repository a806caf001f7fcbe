"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, ERNIE-4.5-MoE, DeepSeek-V3): a top-k router, SwiGLU experts
and optionally shared experts every token goes through (ERNIE, DeepSeek).

The router is softmax (probabilities; ERNIE adds a score bias to the choice only) or sigmoid (DeepSeek-V3:
independent scores, the choice limited to the `topk_expert_groups` groups whose two best biased scores sum
highest, weights scaled by routed_scaling_factor). The score bias is not trained by gradients: with
model.router_bias_update_rate the trainer moves it after each step (`update_score_bias`, DeepSeek-V3's
auxiliary-loss-free balancing).

Routing is dropless by default: every token reaches each of its top-k experts. With model.moe_capacity_factor
each expert takes at most ceil(factor * tokens * top-k / experts) of them, those of the highest router
weight; the rest are dropped (they add nothing; the residual stream and shared experts carry the token).
Under tensor or context parallelism, where each rank routes a part of the sequences, the ranks drop what one
process drops (llmtrain.parallel.tensor_parallel.share_capacity).
Each layer's experts are stacked tensors, `gate_up_proj` (experts, 2 * ffn, hidden) with rows [0:ffn] the
gate and [ffn:2ffn] the up projection of each expert, and `down_proj` (experts, hidden, ffn), as transformers
holds them in memory. Tokens are sorted by expert and one grouped GEMM (kernels.moe_experts) multiplies
each expert's contiguous run of rows.

The load-balancing loss is transformers' `load_balancing_loss_func`: over all MoE layers together,
num_experts * sum_e f_e * P_e, where f_e is the share of top-k assignments to expert e (the shares sum
to top-k) and P_e its mean router probability (a sigmoid router's scores normalised to sum to 1 per token),
both pooled over layers before the product. The router z-loss is ST-MoE's, pooled the same way: the mean over
tokens and MoE layers of logsumexp(router logits)^2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from llmtrain.config import ModelConfig
from llmtrain.models.moe_permute import ExpertOrder, combine, to_experts
from llmtrain.models.registry import ArchSpec

# ERNIE's moe_norm_min, applied to every arch: a top-k chosen by probability sums to at least 1/experts, so
# the clamp only acts when a score bias picked experts of (almost) zero probability.
NORM_MIN = 1e-12


@dataclass
class RouterStats:
    """What one MoE layer's last forward routed, for the router losses and the load metrics."""

    tokens_per_expert: torch.Tensor
    """(experts,) fp32 count of the top-k assignments routed to each expert (no gradient)."""
    prob_sum: torch.Tensor
    """(experts,) fp32 sum over tokens of the router probability of each expert (carries the gradient)."""
    rows: int
    """Tokens routed."""
    balance_tokens: torch.Tensor
    """(experts,) what the load-balancing loss counts: each token's top-k by probability alone, which is
    the routing itself unless a score bias shifts the choice (ERNIE counts without the bias)."""
    z_sum: torch.Tensor
    """0-d fp32 sum over tokens of logsumexp(router logits)^2 (carries the gradient)."""
    dropped: torch.Tensor
    """0-d fp32 count of the assignments dropped by the expert capacity (no gradient)."""


@dataclass(frozen=True)
class Routing:
    """One forward's routing decision for (tokens, hidden) input."""

    logits: torch.Tensor
    """(tokens, experts) fp32 router logits."""
    probs: torch.Tensor
    """(tokens, experts) fp32 probabilities (softmax, or sigmoid scores normalised per token)."""
    weights: torch.Tensor
    """(tokens, k) fp32 weight of each chosen expert."""
    experts: torch.Tensor
    """(tokens, k) ids of the chosen experts."""


class Router(nn.Module):
    """Linear scores -> softmax or sigmoid (fp32) -> top-k (see the module docstring), optionally
    renormalised to sum to 1 per token.

    With the arch's router_score_bias the scores are computed in fp32 and the top-k is chosen by score plus
    `score_bias`, a per-expert bias that gradients do not train (requires_grad off; e_score_correction_bias
    in transformers); the weights stay the chosen experts' scores.
    """

    def __init__(self, spec: ArchSpec, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.score_bias = (
            nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
            if spec.router_score_bias
            else None
        )
        self.sigmoid = spec.router == "sigmoid"
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.groups, self.topk_groups = cfg.num_expert_groups, cfg.topk_expert_groups
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> Routing:
        """(tokens, hidden) -> the Routing of these tokens."""
        if self.score_bias is None:
            logits = F.linear(x, self.weight).float()
        else:
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else F.softmax(logits, dim=-1)
        choice = scores if self.score_bias is None else scores + self.score_bias
        if self.topk_groups < self.groups:
            choice = self._limit_groups(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        return Routing(logits, probs, weights, experts)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with -inf outside each token's topk_groups groups, ranked by their two best scores."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        chosen = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device)
        keep.scatter_(1, chosen, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def capacity_keep(
    weights: torch.Tensor, experts: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """(tokens, k) bool: which assignments fit their expert's `capacity`, each expert keeping those of the
    highest weight (ties: the earlier token)."""
    flat, w = experts.flatten(), weights.detach().flatten()
    by_weight = w.argsort(descending=True, stable=True)
    order = by_weight[flat[by_weight].argsort(stable=True)]  # by expert, then by falling weight
    counts = torch.bincount(flat, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(experts)


Dispatch = Callable[[torch.Tensor, list[int], "Experts"], torch.Tensor]
"""(rows sorted by global expert, count per global expert, the Experts) -> each row's expert output, in
the same order: how expert parallelism (llmtrain.parallel.expert_parallel) computes experts held
elsewhere."""

GroupedMM = Callable[[torch.Tensor, "torch.Tensor | list[int]", torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows, counts, gate_up, down) -> the SwiGLU experts' output, kernels.moe_experts' signature: how
train.fp8_grouped_mm (llmtrain.parallel.float8_experts) computes the experts in float8."""


class Experts(nn.Module):
    """The SwiGLU experts of one layer, stored stacked (see the module docstring). With `dispatch` set
    (expert parallelism) this rank holds only some experts and `dispatch` computes every routed row."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        self.num_experts = e
        self.impl = cfg.kernels
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.dispatch: Dispatch | None = None
        self.grouped_mm: GroupedMM | None = None

    def compute(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """The experts this module holds over `rows` sorted by (local) expert, counts[e] rows each: the
        `grouped_mm` set (float8 under train.fp8_grouped_mm), else kernels.moe_experts (bf16)."""
        gemm = self.grouped_mm or partial(kernels.moe_experts, impl=self.impl)
        return gemm(rows, counts, self.gate_up_proj, self.down_proj)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """(tokens, hidden) -> sum over each token's k experts of weight * expert(token), leaving out the
        assignments `keep` (tokens, k) marks False (None: keep all)."""
        top_k, n = experts.shape[1], self.num_experts
        slots = experts.flatten()
        if keep is not None:  # dropped assignments go to a slot past the last expert, never computed
            slots = slots.masked_fill(~keep.flatten(), n)
        counts = torch.bincount(slots, minlength=n + 1)[:n]
        order = slots.argsort(stable=True)[: int(counts.sum())]
        where = ExpertOrder.of(order, x.shape[0], top_k)
        rows = to_experts(x, where)
        if self.dispatch is None:
            out = self.compute(rows, counts)
        else:
            out = self.dispatch(rows, counts.tolist(), self)
        # The router weights (fp32) stay fp32 through the product, as transformers' Mixtral computes it.
        return combine(out, weights, where)


class MoEMLP(nn.Module):
    """Routed experts (plus `shared_experts`, a dense MLP every token goes through, if given) in place of
    a dense MLP; remembers its last RouterStats in `stats`."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(spec, cfg)
        self.experts = Experts(cfg)
        self.shared_experts = shared_experts
        self.capacity_factor = cfg.moe_capacity_factor
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.router(flat)
        n, k = self.experts.num_experts, self.router.top_k
        counts = torch.bincount(r.experts.flatten(), minlength=n).float()
        balance = counts
        if self.router.score_bias is not None and not self.router.sigmoid:
            balance = torch.bincount(r.probs.topk(k, dim=-1).indices.flatten(), minlength=n).float()
        keep = None
        if self.capacity_factor is not None:
            keep = self.keep_within_capacity(r.weights, r.experts, x.shape[:-1])
        dropped = (~keep).sum().float() if keep is not None else counts.new_zeros(())
        z_sum = torch.logsumexp(r.logits, dim=-1).square().sum()
        # Kept on the module rather than returned: blocks keep their x -> x interface, and CausalLM.loss
        # pools the statistics of every layer as the router losses need.
        self.stats = RouterStats(counts, r.probs.sum(dim=0), flat.shape[0], balance, z_sum, dropped)
        out = self.experts(flat, r.weights, r.experts, keep)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)

    def keep_within_capacity(
        self, weights: torch.Tensor, experts: torch.Tensor, lead: torch.Size
    ) -> torch.Tensor:
        """(tokens, k) which of these tokens' assignments fit their expert's capacity; `lead` is the input's
        shape without the hidden dimension. Tensor and context parallelism replace it per instance so that
        the ranks sharing a sequence drop what one process would (tensor_parallel.share_capacity)."""
        n = self.experts.num_experts
        capacity = expert_capacity(self.capacity_factor, lead.numel(), experts.shape[1], n)
        return capacity_keep(weights, experts, n, capacity)


def expert_capacity(factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Slots per expert when `tokens` tokens are routed to top_k of num_experts experts each."""
    return math.ceil(factor * tokens * top_k / num_experts)


def expert_load(stats: list[RouterStats]) -> torch.Tensor:
    """(MoE layers, experts) fp32 tokens routed to each expert of each layer (top-k assignments)."""
    return torch.stack([s.tokens_per_expert for s in stats])


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func of the given layers' statistics (see the module docstring)."""
    rows = sum(s.rows for s in stats)
    tokens = torch.stack([s.balance_tokens for s in stats]).sum(dim=0) / rows
    probs = torch.stack([s.prob_sum for s in stats]).sum(dim=0) / rows
    return num_experts * (tokens * probs).sum()


def z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """ST-MoE's router z-loss of the given layers: mean over their tokens of logsumexp(logits)^2."""
    return torch.stack([s.z_sum for s in stats]).sum() / sum(s.rows for s in stats)


def dropped_fraction(stats: list[RouterStats], top_k: int) -> torch.Tensor:
    """The share of the layers' top-k assignments the expert capacity dropped (0 when dropless)."""
    return torch.stack([s.dropped for s in stats]).sum() / (top_k * sum(s.rows for s in stats))


@dataclass
class RouterFigures:
    """What a mixture-of-experts model's routers did in one train_step (on this rank)."""

    aux_loss: torch.Tensor
    """Mean over micro-batches of the load-balancing loss (before router_aux_loss_coef), 0-d."""
    z_loss: torch.Tensor
    """Mean over micro-batches of the router z-loss (before router_z_loss_coef), 0-d."""
    dropped: torch.Tensor
    """Mean over micro-batches of the share of top-k assignments the expert capacity dropped, 0-d."""
    expert_load: torch.Tensor
    """(MoE layers, experts) tokens routed to each expert over the step's micro-batches."""

    @staticmethod
    @torch.no_grad()
    def of(stats: list[RouterStats], cfg: ModelConfig) -> RouterFigures:
        """The figures of one forward's statistics (every MoE layer's, in layer order), detached."""
        return RouterFigures(
            load_balancing_loss(stats, cfg.num_experts),
            z_loss(stats),
            dropped_fraction(stats, cfg.num_experts_per_tok),
            expert_load(stats),
        )

    @staticmethod
    def combine(figures: list[RouterFigures]) -> RouterFigures:
        """One step's figures from its micro-batches' (means of the losses, sums of the loads)."""
        mean = [
            torch.stack([getattr(f, k) for f in figures]).mean() for k in ("aux_loss", "z_loss", "dropped")
        ]
        return RouterFigures(*mean, sum(f.expert_load for f in figures))

    def metrics(self) -> dict[str, Any]:
        """aux_loss, z_loss, dropped_fraction, and expert_load_max / expert_load_mean: the busiest expert's
        tokens over all MoE layers and the mean tokens per expert (their ratio is 1 when the routers balance
        perfectly), with expert_load_layers: that ratio for each MoE layer."""
        per_layer = self.expert_load.max(dim=1).values / self.expert_load.mean(dim=1).clamp(min=1e-9)
        return {
            "aux_loss": float(self.aux_loss),
            "z_loss": float(self.z_loss),
            "dropped_fraction": float(self.dropped),
            "expert_load_max": float(self.expert_load.max()),
            "expert_load_mean": float(self.expert_load.mean()),
            "expert_load_layers": [round(float(r), 4) for r in per_layer],
        }


@torch.no_grad()
def update_score_bias(routers: list[Router], load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each router's score bias += rate * sign(mean load - load)
    of its layer's row of `load` (MoE layers, experts), so busy experts become less likely to be chosen."""
    for router, row in zip(routers, load, strict=True):
        router.score_bias += rate * torch.sign(row.mean() - row).to(router.score_bias)
