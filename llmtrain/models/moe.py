"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, ERNIE-4.5-MoE): a softmax top-k router, SwiGLU experts and
optionally shared experts every token goes through (ERNIE).

Routing is dropless: every token reaches each of its top-k experts, with no capacity limit. Each layer's
experts are stacked tensors, `gate_up_proj` (experts, 2 * ffn, hidden) with rows [0:ffn] the gate and
[ffn:2ffn] the up projection of each expert, and `down_proj` (experts, hidden, ffn), as transformers holds
them in memory. Tokens are sorted by expert and each expert multiplies its contiguous run of rows.

The load-balancing loss is transformers' `load_balancing_loss_func`: over all MoE layers together,
num_experts * sum_e f_e * P_e, where f_e is the share of top-k assignments to expert e (the shares sum
to top-k) and P_e its mean router probability, both pooled over layers before the product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from llmtrain.config import ModelConfig
from llmtrain.models.registry import ArchSpec

# ERNIE's moe_norm_min, applied to every arch: a top-k chosen by probability sums to at least 1/experts, so
# the clamp only acts when a score bias picked experts of (almost) zero probability.
NORM_MIN = 1e-12


@dataclass
class RouterStats:
    """What one MoE layer's last forward routed, for the load-balancing loss and the load metrics."""

    tokens_per_expert: torch.Tensor
    """(experts,) fp32 count of the top-k assignments routed to each expert (no gradient)."""
    prob_sum: torch.Tensor
    """(experts,) fp32 sum over tokens of the router probability of each expert (carries the gradient)."""
    rows: int
    """Tokens routed."""
    balance_tokens: torch.Tensor
    """(experts,) what the load-balancing loss counts: each token's top-k by probability alone, which is
    the routing itself unless a score bias shifts the choice (ERNIE counts without the bias)."""


class Router(nn.Module):
    """Linear scores -> softmax (fp32) -> top-k, optionally renormalised to sum to 1 per token.

    With the arch's router_score_bias (ERNIE) the scores are computed in fp32 and the top-k is chosen by
    probability plus `score_bias`, a per-expert bias that is not trained by gradients (requires_grad off;
    ERNIE's e_score_correction_bias); the weights stay the chosen experts' probabilities.
    """

    def __init__(self, spec: ArchSpec, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.score_bias = (
            nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
            if spec.router_score_bias
            else None
        )
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden) -> (probs (tokens, experts), top-k weights (tokens, k), top-k expert ids),
        probabilities and weights in fp32."""
        if self.score_bias is None:
            probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:
            probs = F.softmax(F.linear(x.float(), self.weight.float()), dim=-1)
            experts = (probs + self.score_bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)
        return probs, weights, experts


class Experts(nn.Module):
    """The SwiGLU experts of one layer, stored stacked (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        self.num_experts = e
        self.impl = cfg.kernels
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """(tokens, hidden) -> sum over each token's k experts of weight * expert(token); `counts[e]` is the
        number of (token, slot) pairs routed to expert e."""
        top_k = experts.shape[1]
        order = experts.flatten().argsort(stable=True)
        token = order // top_k  # the token of each (token, slot) pair, grouped by expert
        outputs = []
        for e, rows in enumerate(x[token].split(counts)):
            if rows.shape[0] == 0:
                continue
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(kernels.swiglu(gate, up, impl=self.impl), self.down_proj[e]))
        # The router weights stay fp32 through the product, as transformers' Mixtral computes it.
        weighted = (torch.cat(outputs).float() * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, weighted)


class MoEMLP(nn.Module):
    """Routed experts (plus `shared_experts`, a dense MLP every token goes through, if given) in place of
    a dense MLP; remembers its last RouterStats in `stats`."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(spec, cfg)
        self.experts = Experts(cfg)
        self.shared_experts = shared_experts
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, experts = self.router(flat)
        n = self.experts.num_experts
        counts = torch.bincount(experts.flatten(), minlength=n)
        balance = counts
        if self.router.score_bias is not None:
            balance = torch.bincount(probs.topk(self.router.top_k, dim=-1).indices.flatten(), minlength=n)
        # Kept on the module rather than returned: blocks keep their x -> x interface, and CausalLM.loss
        # pools the statistics of every layer as the load-balancing loss needs.
        self.stats = RouterStats(counts.float(), probs.sum(dim=0), flat.shape[0], balance.float())
        out = self.experts(flat, weights, experts, counts.tolist())
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


def expert_load(stats: list[RouterStats]) -> torch.Tensor:
    """(MoE layers, experts) fp32 tokens routed to each expert of each layer (top-k assignments)."""
    return torch.stack([s.tokens_per_expert for s in stats])


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func of the given layers' statistics (see the module docstring)."""
    rows = sum(s.rows for s in stats)
    tokens = torch.stack([s.balance_tokens for s in stats]).sum(dim=0) / rows
    probs = torch.stack([s.prob_sum for s in stats]).sum(dim=0) / rows
    return num_experts * (tokens * probs).sum()
