"""The rules of multi-token prediction (model.mtp_layers, llmtrain.models.mtp), stated once. Every parallel
layout takes the modules: under pipeline parallelism they run on the last stage, beside the output layer,
with a copy of the embedding kept in sync with the first stage's (llmtrain.pipeline.stages)."""

from __future__ import annotations

from llmtrain.config.schema import JobConfig


def mtp_problem(job: JobConfig) -> str:
    """Why `job` cannot train with model.mtp_layers multi-token prediction modules ("" if it can)."""
    m = job.model
    if m.mtp_layers < 0:
        return f"model.mtp_layers must be >= 0 (0: no multi-token prediction); got {m.mtp_layers}"
    for name in ("mtp_loss_weight", "mtp_loss_weight_later", "mtp_loss_weight_tokens"):
        value = getattr(m, name)
        if value is not None and value < 0:
            return f"model.{name} must be >= 0; got {value}"
    if m.mtp_layers == 0:
        return ""
    if m.arch == "gpt":
        return (
            "model.mtp_layers needs an architecture without learned positions (the modules embed the token "
            "k ahead at position i): model.arch=gpt has them; use a rotary arch or set model.mtp_layers=0"
        )
    if m.mtp_layers >= m.seq_length:
        return (
            f"model.mtp_layers={m.mtp_layers} leaves no position a target in a sequence of model.seq_length="
            f"{m.seq_length} tokens; lower mtp_layers below seq_length"
        )
    return ""
