"""Whether the optimizer fields can run a job: Muon's hyperparameters and the engines that can take it.

As in llmtrain.config.layout_rules, `optimizer_problem` returns "" or the message naming the field and the
fix. Which parameters Muon updates (and the shapes it refuses at build time) is llmtrain.parallel.muon's.
"""

from __future__ import annotations

from llmtrain.config.schema import JobConfig

# torch.optim.Muon refuses 100 or more Newton-Schulz steps ("for computational efficiency").
MAX_NS_STEPS = 99


def optimizer_problem(job: JobConfig) -> str:
    """Why train.optimizer and the train.muon_* fields cannot run this job ("" if they can)."""
    t = job.train
    if t.optimizer != "muon":
        return ""
    if job.parallel.engine == "deepspeed":
        return (
            "train.optimizer=muon runs on parallel.engine=llmtrain (the DeepSpeed engine brings its own "
            "AdamW); set parallel.engine=llmtrain or train.optimizer=adamw"
        )
    if not 0 <= t.muon_momentum < 1:
        return f"train.muon_momentum must be in [0, 1); got {t.muon_momentum} (Muon's default: 0.95)"
    if not 1 <= t.muon_ns_steps <= MAX_NS_STEPS:
        return f"train.muon_ns_steps must be 1 to {MAX_NS_STEPS}; got {t.muon_ns_steps} (default 5)"
    if len(t.muon_ns_coefficients) != 3:
        return (
            f"train.muon_ns_coefficients must be three numbers (a, b, c); got {t.muon_ns_coefficients} "
            "(default [3.4445, -4.775, 2.0315])"
        )
    if t.muon_lr is not None and t.muon_lr <= 0:
        return f"train.muon_lr must be positive or null (train.lr); got {t.muon_lr}"
    return ""
