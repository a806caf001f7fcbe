"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2): `model.mtp_layers` sequential modules
after the main model, module k predicting the token k + 1 places ahead of each position.

Module k (1..D) combines the representation h^{k-1} of each position i (h^0: the main model's final-normed
hidden state; h^{k-1}: module k-1's final-normed output) with the embedding of token t_{i+k}:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      (eh_proj of enorm(.) and hnorm(.))
    h^k    = final_norm_k(Block_k(h'^k))                         (one transformer block, dense or MoE)
    logits = OutHead(h^k)                                        (the main model's output layer)

with the main model's embedding and output layer shared. The report writes the concatenation as [h; emb];
its published weights (eh_proj in Hugging Face's layout), Megatron-Core and vLLM put the embedding first,
as here: the two differ only by the order of M_k's column blocks. The loss of depth k is the mean
cross-entropy over the positions whose target t_{i+k+1} exists (the last k positions have none), and the
training loss adds lambda / D * sum_k of them, lambda = model.mtp_loss_weight (`mtp_loss_weight` gives
the published schedule). Every module runs on the full sequence length, as Megatron-Core rolls it: causal
attention keeps the positions without a target (embedding token 0) from reaching the others, and the
shapes stay those of the main model under tensor, sequence and context parallelism.

The modules take the labels (the inputs shifted by one) rather than the inputs: t_{i+k} is labels[i+k-1]
and the target t_{i+k+1} is labels[i+k], so a pipeline's last stage, which holds the labels, needs no more.
Under context parallelism the labels are shifted on the whole sequences before the split (`shifted`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmtrain.config import ModelConfig
from llmtrain.models.layers import Rope, TransformerBlock, make_norm
from llmtrain.models.registry import ArchSpec

IGNORE = -100
"""Labels the loss skips (kernels.cross_entropy's ignore index)."""


def mtp_loss_weight(cfg: ModelConfig, tokens: int) -> float:
    """lambda after `tokens` trained tokens: model.mtp_loss_weight, then model.mtp_loss_weight_later from
    model.mtp_loss_weight_tokens on (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)."""
    if cfg.mtp_loss_weight_later is not None and tokens >= cfg.mtp_loss_weight_tokens:
        return cfg.mtp_loss_weight_later
    return cfg.mtp_loss_weight


def shifted(labels: torch.Tensor, k: int) -> torch.Tensor:
    """(b, s) labels moved k places left, the last k filled with IGNORE: labels[:, i + k] at i."""
    if k == 0:
        return labels
    out = torch.full_like(labels, IGNORE)
    out[:, :-k] = labels[:, k:]
    return out


class MTPModule(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a transformer block and its final norm (shared_head.norm)."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, depth: int) -> None:
        super().__init__()
        self.enorm = make_norm(spec, cfg)
        self.hnorm = make_norm(spec, cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        # Layer index num_layers + depth: an MoE block where the config makes that layer one (DeepSeek-V3).
        self.block = TransformerBlock(spec, cfg, cfg.num_layers + depth)
        self.final_norm = make_norm(spec, cfg)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, rope: Rope, documents: torch.Tensor | None
    ) -> torch.Tensor:
        """h^{k-1} (normed) and Emb(t_{i+k}), both (b, s, hidden) -> Block_k's output, before final_norm.

        The norms are called through `forward`, which tensor parallelism's region hooks do not wrap: their
        inputs and outputs stay in the residual stream's layout (replicated, or sequence-sharded with SP)."""
        combined = torch.cat([self.enorm.forward(embedded), self.hnorm.forward(hidden)], dim=-1)
        return self.block(self.eh_proj(combined), rope, documents)


class MultiTokenPrediction(nn.Module):
    """The D modules (`layers`), the current lambda (`weight`, set by the trainer) and the last training
    forward's cross-entropy of each depth (`last_losses`, detached, (D,))."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPModule(spec, cfg, k) for k in range(cfg.mtp_layers))
        self.weight = cfg.mtp_loss_weight
        self.last_losses: torch.Tensor | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        labels: list[torch.Tensor],
        embed: Callable[[torch.Tensor], torch.Tensor],
        head_loss: Callable[[torch.Tensor, nn.Module, torch.Tensor], torch.Tensor],
        rope: Rope,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """lambda / D * sum_k CE_k (0-d fp32). `hidden`: h^0, the main model's final-normed hidden states in
        the residual stream's layout; `labels[k]`: the labels shifted by k (this rank's part of them,
        `shifted` on the whole sequences), k = 0..D; `embed`: token ids -> embeddings; `head_loss`: (block
        output, its final norm, labels) -> mean cross-entropy through the shared output layer."""
        losses = []
        for k, module in enumerate(self.layers):
            tokens = labels[k].clamp(min=0)  # t_{i+k+1} (0-based k); positions past the end embed token 0
            x = module(hidden, embed(tokens), rope, documents)
            losses.append(head_loss(x, module.final_norm, labels[k + 1]))
            if k + 1 < len(self.layers):
                hidden = module.final_norm.forward(x)
        stacked = torch.stack(losses).float()
        self.last_losses = stacked.detach()
        return self.weight * stacked.mean()


def mtp_losses(model: nn.Module) -> torch.Tensor | None:
    """The last training forward's per-depth cross-entropy of `model`'s MTP modules (any wrapper of a
    CausalLM or pipeline stages holding them); None without any."""
    for module in model.modules():
        if isinstance(module, MultiTokenPrediction):
            return module.last_losses
    return None


def set_mtp_loss_weight(model: nn.Module, weight: float) -> None:
    """Set lambda in every MultiTokenPrediction of `model` (the trainer, at each step)."""
    for module in model.modules():
        if isinstance(module, MultiTokenPrediction):
            module.weight = weight
