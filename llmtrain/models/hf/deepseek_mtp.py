"""DeepSeek-V3's multi-token prediction modules in the Hugging Face layout (the published checkpoint's, which
README_WEIGHTS.md of deepseek-ai/DeepSeek-V3 describes) <-> llmtrain's `mtp.layers.<k>` (llmtrain.models.mtp).

Module k is decoder layer num_hidden_layers + k: `enorm`, `hnorm`, `eh_proj` (embedding half first),
a decoder layer's attention, norms and MLP (MoE where first_k_dense_replace makes that layer one), and
`shared_head.norm` (the module's final norm). The layer also carries copies of the main model's embedding
(`embed_tokens`) and output layer (`shared_head.head`), which llmtrain shares: export writes the copies,
import checks they equal the main tensors and keeps one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmtrain.config import ModelConfig
from llmtrain.models.hf.adapter import ModelFormatError, Rule, TensorMap, Tensors, rename
from llmtrain.models.hf.decoder import LayerRules, layer_rules


def _shared(names: tuple[str, ...]) -> TensorMap:
    """Hugging Face's tensor and its copies -> the one llmtrain tensor, refusing copies that differ."""

    def to_ours(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        for name, t in zip(names[1:], ts[1:], strict=True):
            if not torch.equal(t, ts[0]):
                raise ModelFormatError(
                    f"{name} differs from {names[0]}; llmtrain's multi-token prediction modules share the "
                    "main model's embedding and output layer, so the checkpoint's copies must equal them"
                )
        return [ts[0]]

    return to_ours


def _copies(n: int) -> TensorMap:
    return lambda ts: [ts[0]] + [ts[0].clone() for _ in range(n - 1)]


def shared_rule(hf: str, ours: str, copies: list[str]) -> Rule:
    """`hf` and its `copies` in the MTP layers <-> the one llmtrain tensor `ours`."""
    names = (hf, *copies)
    return Rule(names, (ours,), _shared(names), _copies(len(names)))


def mtp_rules(cfg: ModelConfig, attention: LayerRules, moe_layer: LayerRules) -> list[Rule]:
    """The modules' own tensors, module by module (the shared copies are `shared_rule`'s)."""
    rules: list[Rule] = []
    for k in range(cfg.mtp_layers):
        index = cfg.num_layers + k
        h, o = f"model.layers.{index}.", f"mtp.layers.{k}."
        rules += [rename(f"{h}{n}.weight", f"{o}{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
        rules += layer_rules(cfg, index, h, f"{o}block.", attention, moe_layer)
        rules.append(rename(f"{h}shared_head.norm.weight", f"{o}final_norm.weight"))
    return rules


def with_mtp(
    decoder: Callable[[ModelConfig], list[Rule]], attention: LayerRules, moe_layer: LayerRules
) -> Callable[[ModelConfig], list[Rule]]:
    """The rules of `decoder` with the embedding and output layer carrying the MTP layers' copies, then the
    output layer (untied), then the MTP modules: llmtrain's parameter order."""

    def rules(cfg: ModelConfig) -> list[Rule]:
        out = decoder(cfg)
        if not cfg.mtp_layers:
            return out
        layers = [f"model.layers.{cfg.num_layers + k}." for k in range(cfg.mtp_layers)]
        embed = [f"{h}embed_tokens.weight" for h in layers]
        head = [f"{h}shared_head.head.weight" for h in layers]
        if cfg.tied_embeddings:
            embed += head
        else:
            out.append(shared_rule("lm_head.weight", "lm_head.weight", head))
        first = out[0]
        out[0] = shared_rule(first.hf[0], first.ours[0], embed)
        return out + mtp_rules(cfg, attention, moe_layer)

    return rules


def mtp_layers_present(cfg: ModelConfig, hf_state: Tensors) -> int:
    """How many of the config's MTP layers the checkpoint holds: transformers' DeepseekV3ForCausalLM saves
    none whatever its num_nextn_predict_layers says."""
    present = 0
    while present < cfg.mtp_layers and f"model.layers.{cfg.num_layers + present}.eh_proj.weight" in hf_state:
        present += 1
    return present
