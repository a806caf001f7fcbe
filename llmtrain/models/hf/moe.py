"""Mixture-of-experts pieces the MoE families share: the common config.json fields, the rules between
transformers' one tensor per expert and projection and llmtrain's stacked experts, and the split of
transformers >= 5's stacked in-memory experts into checkpoint names."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import (
    ModelFormatError,
    Rule,
    Tensors,
    gated_mlp_rules,
    rename,
    stack,
    unstack,
)


def _stack_gate_up(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    # ts: gate_0, up_0, gate_1, up_1, ...: expert e's rows are [gate_e; up_e].
    return [torch.stack([torch.cat(ts[i : i + 2], dim=0) for i in range(0, len(ts), 2)])]


def _unstack_gate_up(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for expert in ts[0] for t in expert.chunk(2, dim=0)]


_STACKED_MOE_KEY = re.compile(
    r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)"
)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where a family's checkpoint keeps an MoE layer's tensors: names, under a decoder layer's prefix, of the
    router and of expert `{e}`'s gate, up and down projections; and the rules and renames that follow."""

    router: str
    gate: str
    up: str
    down: str

    def layer_rules(self, cfg: ModelConfig, h: str, o: str) -> list[Rule]:
        """One MoE layer under prefixes `h` / `o`: its shared experts (if any), router and stacked experts."""
        rules = []
        if cfg.num_shared_experts:
            rules += gated_mlp_rules(f"{h}mlp.shared_experts.", f"{o}mlp.shared_experts.", ("weight",))
        experts = range(cfg.num_experts)
        return rules + [
            rename(f"{h}{self.router}", f"{o}mlp.router.weight"),
            Rule(
                tuple(f"{h}{name.format(e=e)}" for e in experts for name in (self.gate, self.up)),
                (f"{o}mlp.experts.gate_up_proj",),
                _stack_gate_up,
                _unstack_gate_up,
            ),
            Rule(
                tuple(f"{h}{self.down.format(e=e)}" for e in experts),
                (f"{o}mlp.experts.down_proj",),
                stack,
                unstack,
            ),
        ]

    def checkpoint_names(self, cfg: ModelConfig, hf_state: Tensors) -> Tensors:
        """`hf_state` with transformers >= 5's in-memory MoE tensors (`mlp.gate.weight`,
        `mlp.experts.gate_up_proj` (experts, 2 * ffn, hidden), `mlp.experts.down_proj`) under their
        checkpoint names, one tensor per expert and projection; other tensors unchanged."""
        out: Tensors = {}
        for key, value in hf_state.items():
            match = _STACKED_MOE_KEY.fullmatch(key)
            if match is None:
                out[key] = value
                continue
            h, what = match.groups()
            if what == "gate.weight":
                out[f"{h}{self.router}"] = value
            elif what == "experts.gate_up_proj":
                halves = iter(_unstack_gate_up([value]))
                for e in range(value.shape[0]):
                    out[f"{h}{self.gate.format(e=e)}"] = next(halves)
                    out[f"{h}{self.up.format(e=e)}"] = next(halves)
            else:
                out.update((f"{h}{self.down.format(e=e)}", t) for e, t in enumerate(unstack([value])))
        return out


# The names transformers' Qwen3-MoE, ERNIE-4.5-MoE and DeepSeek-V3 checkpoints share.
MLP_EXPERTS = ExpertLayout(
    "mlp.gate.weight",
    "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
)


def moe_fields(
    hf: dict[str, Any], *, sliding_window: bool, num_experts: int, num_experts_per_tok: int
) -> dict[str, Any]:
    """ModelConfig fields of the expert count, top-k and aux loss; `sliding_window` is the family's
    use_sliding_window default, the other keywords its defaults for keys a config.json leaves out."""
    model_type = hf["model_type"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", sliding_window) else None
    if window is not None:
        raise ModelFormatError(
            f"{model_type} sliding_window={window} is not supported; llmtrain attends over the whole sequence"
        )
    # Mixtral names the expert count num_local_experts; transformers writes Qwen3-MoE's under that name too.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return {
        "num_experts": experts if experts is not None else num_experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok", num_experts_per_tok),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields Mixtral and Qwen3-MoE write alike."""
    return {
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        # Inference default; training with transformers adds the aux loss once this is turned on.
        "output_router_logits": False,
        "attention_dropout": cfg.attention_dropout,
    }
