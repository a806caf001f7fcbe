"""torch's own optimizers set up as train.optimizer=muon sets up ours: the references of the Muon tests."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.config import JobConfig
from llmtrain.parallel.muon import muon_updates
from llmtrain.parallel.optimizer import no_weight_decay


def shape_of(parts: list[torch.nn.Parameter]) -> tuple[int, ...]:
    """The shape of a parameter kept as `parts` (one per expert of a 3-D stack, else itself alone)."""
    return tuple(parts[0].shape) if len(parts) == 1 else (len(parts), *parts[0].shape)


def torch_pair(
    job: JobConfig, named: dict[str, list[torch.nn.Parameter]], **adamw_options: Any
) -> tuple[torch.optim.AdamW, torch.optim.Muon]:
    """torch.optim.AdamW over the AdamW parameters (llmtrain's decay groups; `adamw_options` such as fused)
    and torch.optim.Muon over the Muon ones, from the job's hyperparameters. torch.optim.Muon takes 2-D
    parameters only: `named` keeps each parameter as a list of parts, a stack of experts one part per
    expert."""
    t = job.train
    muon = [e for n, parts in named.items() if muon_updates(n, shape_of(parts)) for e in parts]
    rest = {n: parts[0] for n, parts in named.items() if not muon_updates(n, shape_of(parts))}
    groups = [
        {"params": [p for n, p in rest.items() if not no_weight_decay(n, p)], "weight_decay": t.weight_decay},
        {"params": [p for n, p in rest.items() if no_weight_decay(n, p)], "weight_decay": 0.0},
    ]
    betas = (t.adam_beta1, t.adam_beta2)
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps, **adamw_options)
    ref_muon = torch.optim.Muon(
        muon,
        lr=t.muon_lr or t.lr,
        weight_decay=t.weight_decay if t.muon_weight_decay is None else t.muon_weight_decay,
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_coefficients=tuple(t.muon_ns_coefficients),
        ns_steps=t.muon_ns_steps,
        adjust_lr_fn=t.muon_adjust_lr,
    )
    return adamw, ref_muon
