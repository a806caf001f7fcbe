"""The decoder-only language model shared by every architecture, and `build`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kernels
from llmtrain.config import JobConfig, ModelConfig, validate
from llmtrain.models.documents import document_ids, document_positions
from llmtrain.models.init import init_weights
from llmtrain.models.layers import Rope, TransformerBlock, make_norm
from llmtrain.models.moe import MoEMLP, Router, RouterStats, load_balancing_loss, z_loss
from llmtrain.models.mtp import MultiTokenPrediction, shifted
from llmtrain.models.registry import get_arch
from llmtrain.models.rope import cos_sin_factor, inv_freq


class CausalLM(nn.Module):
    """Embeddings, a stack of TransformerBlocks, final norm and LM head; with model.mtp_layers the
    multi-token prediction modules (`mtp`, llmtrain.models.mtp), run by training forwards with labels.

    Pipeline stages call the pieces (`embed`, `rope`, iterate `layers`, `head`, `loss`) themselves;
    `forward` chains them for a single stage. Parameters are left uninitialised: use `build`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.spec = get_arch(cfg.arch)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = (
            nn.Embedding(cfg.max_positions, cfg.hidden_size) if self.spec.learned_positions else None
        )
        self.embed_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(TransformerBlock(self.spec, cfg, i) for i in range(cfg.num_layers))
        self.final_norm = make_norm(self.spec, cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(self.spec, cfg) if cfg.mtp_layers else None
        self.loss_tp_group = None
        # Context parallelism (set by llmtrain.parallel.context_parallel.apply_cp): splits whole sequences'
        # inputs into this rank's chunks (split_inputs) and sums the loss over the split (reduce_loss).
        self.context: Any = None
        # ZeRO-2/3 over the vocabulary (set by llmtrain.parallel.fsdp.apply_fsdp): embeds and computes the
        # loss from this rank's row shards of embed_tokens and lm_head, so neither is ever gathered whole.
        self.vocab_sharded: Any = None
        # Packed documents (data.reset_attention_mask; the trainer sets it): the end-of-document token id.
        # Attention then stays inside documents and positions restart after each one.
        self.document_separator: int | None = None
        self.tie_weights()
        # cos/sin per (seq_len, device, dtype): recomputing them every step costs as much as a small kernel.
        self._rope_cache: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        """Make lm_head share embed_tokens' weight when the config ties them (again after to_empty)."""
        if self.config.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings of (b, s) ids -> (b, s, hidden), after embed_dropout."""
        if self.vocab_sharded is not None:
            x = self.vocab_sharded.embed(input_ids, self.embed_tokens.weight)
        else:
            x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            if position_ids is None:
                n_pos = self.embed_positions.num_embeddings
                if input_ids.shape[1] > n_pos:
                    raise ValueError(
                        f"a sequence of {input_ids.shape[1]} tokens exceeds the {n_pos} learned positions; "
                        "raise model.max_position_embeddings"
                    )
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.embed_positions(position_ids)
        return self.embed_dropout(x)

    def rope(
        self,
        positions: int | torch.Tensor,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Rope:
        """Rotary (cos, sin), each (s, rope_dim) as kernels.apply_rotary takes them; None without rotary.

        `positions` is a sequence length (positions 0..s-1), 1-D position ids, or (b, s) position ids of each
        sample (packed documents), which give (b, s, head_dim) tables. Half layout repeats
        the s x d/2 angles as [angles, angles], interleaved as [a0, a0, a1, a1, ...] (ERNIE).
        """
        if self.spec.rotary == "none":
            return None
        if isinstance(positions, int):
            key = (positions, str(device), dtype)
            if key not in self._rope_cache:
                pos = torch.arange(positions, device=device)
                self._rope_cache[key] = self._rope_from_positions(pos, dtype)
            return self._rope_cache[key]
        if positions.dim() not in (1, 2):
            raise ValueError(
                f"rope: position ids must be (seq,) or (batch, seq); got shape {tuple(positions.shape)}"
            )
        return self._rope_from_positions(positions.to(device) if device is not None else positions, dtype)

    @torch.no_grad()
    def _rope_from_positions(
        self, pos: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = pos.float()[..., None] * inv_freq(self.config).to(pos.device)
        if self.spec.rotary == "interleaved":
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        factor = cos_sin_factor(self.config)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        if not self.spec.rope_fp32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """final_norm then lm_head: (b, s, hidden) -> logits (b, s, vocab)."""
        return self.lm_head(self.final_norm(hidden))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over labels != -100; labels are aligned with logits (already shifted).

        In training mode an MoE model adds router_aux_loss_coef times the load-balancing loss of its
        layers' last forward (as transformers does with output_router_logits) and router_z_loss_coef times
        their z-loss; evaluation reports the cross-entropy alone, comparable with dense models.
        """
        return self._with_router_losses(self.token_loss(logits, labels))

    def _with_router_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """The cross-entropy `loss` plus the MoE router terms of loss() (in training mode)."""
        coef, z_coef = self.config.router_aux_loss_coef, self.config.router_z_loss_coef
        if self.config.is_moe and (coef > 0 or z_coef > 0) and self.training and self.router_stats():
            if coef > 0:
                loss = loss + coef * self.aux_loss()
            if z_coef > 0:
                loss = loss + z_coef * z_loss(self.router_stats())
        return loss

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over labels != -100, of the whole sequences under context parallelism;
        no router terms (pipeline stages add those across stages: llmtrain.pipeline.router_stats)."""
        loss = kernels.cross_entropy(logits, labels, tp_group=self.loss_tp_group, impl=self.config.kernels)
        if self.context is not None:  # this rank's tokens are part of each sequence: the whole one's mean
            loss = self.context.reduce_loss(loss, labels)
        return loss

    def blocks(self) -> list[TransformerBlock]:
        """Every transformer block: the layers, then the multi-token prediction modules' blocks."""
        return list(self.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])

    def routers(self) -> list[Router]:
        """The router of every MoE layer, in `blocks` order (empty for a dense model)."""
        return [layer.mlp.router for layer in self.blocks() if isinstance(layer.mlp, MoEMLP)]

    def router_stats(self) -> list[RouterStats]:
        """The RouterStats of every MoE layer's last forward, in `blocks` order (empty for a dense model);
        the multi-token prediction blocks' are those of the last training forward."""
        stats = [layer.mlp.stats for layer in self.blocks() if isinstance(layer.mlp, MoEMLP)]
        if any(s is None for s in stats):
            raise RuntimeError("the MoE layers have not run a forward yet; call the model first")
        return stats

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss (transformers' load_balancing_loss_func) of the last forward."""
        return load_balancing_loss(self.router_stats(), self.config.num_experts)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (b, s, vocab), or the scalar loss when `labels` (b, s) are given (in training mode with the
        multi-token prediction loss). Under context parallelism the inputs are whole sequences and the
        logits this rank's part of them (model.context)."""
        documents = None
        mtp_labels = None
        if labels is not None and self.mtp is not None and self.training:  # shifted on whole sequences
            mtp_labels = [shifted(labels, k) for k in range(len(self.mtp.layers) + 1)]
        if self.document_separator is not None:  # packed documents, numbered over the whole sequences
            documents = document_ids(input_ids, self.document_separator)
            if position_ids is None:
                position_ids = document_positions(documents)
        if self.context is not None:
            input_ids, labels, position_ids = self.context.split_inputs(input_ids, labels, position_ids)
            if mtp_labels is not None:
                mtp_labels = [self.context.local(t) for t in mtp_labels]
        x = self.embed(input_ids, position_ids)
        rope = self.rope(input_ids.shape[1] if position_ids is None else position_ids, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, documents)
        if labels is None:
            return self.head(x)
        loss = self._head_loss(x, self.final_norm, labels)
        if mtp_labels is not None:
            # final_norm.forward: h^0 in the residual stream's layout (no tensor-parallel region hook).
            hidden = self.final_norm.forward(x)
            loss = loss + self.mtp(hidden, mtp_labels, self.embed, self._head_loss, rope, documents)
        return self._with_router_losses(loss)

    def _head_loss(self, x: torch.Tensor, norm: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of `labels` through `norm` and the output layer (no router terms)."""
        if self.vocab_sharded is not None:
            return self.vocab_sharded.loss(norm(x), self.lm_head.weight, labels)
        return self.token_loss(self.lm_head(norm(x)), labels)


def check_config(cfg: ModelConfig) -> None:
    """Raise llmtrain.config.ConfigError when the model config is inconsistent (names the field)."""
    get_arch(cfg.arch)
    validate(JobConfig(model=cfg))


def empty_model(cfg: ModelConfig, device: torch.device | str | None = None) -> CausalLM:
    """The model with uninitialised storage on `device` (default: torch's default device); no RNG used."""
    check_config(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device if device is not None else torch.get_default_device())
    model.tie_weights()  # to_empty replaces parameters one by one and so unties shared ones
    return model


def build(cfg: ModelConfig, seed: int | None = None) -> CausalLM:
    """The model for `cfg` on torch's default device and dtype, initialised by llmtrain.models.init from
    `seed` (train.seed; None: the seed torch.manual_seed last set, so `torch.manual_seed(s); build(cfg)`
    starts where a run with train.seed=s starts). Torch's global RNG is not drawn from.

    Under `with torch.device("meta"):` it returns a meta model (no memory) for later sharding.
    """
    model = empty_model(cfg)
    init_weights(model, cfg.init_std, torch.initial_seed() if seed is None else seed)
    return model
