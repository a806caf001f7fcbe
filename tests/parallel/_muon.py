"""torch's own optimizers set up as train.optimizer=muon sets up ours: the references of the Muon tests."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.config import JobConfig
from llmtrain.parallel.muon import fused_parts
from llmtrain.parallel.optimizer import no_weight_decay


def muon_blocks(name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The 2-D matrices torch.optim.Muon takes for the parameter `name` (views, in row-major order, so that
    torch.cat of them viewed as `tensor`'s shape is the parameter): one per expert of a stack, and each of
    them split into its fused parts (llmtrain.parallel.muon.fused_parts: SwiGLU's gate and up)."""
    matrices = list(tensor) if tensor.ndim == 3 else [tensor]
    return [block for m in matrices for block in m.chunk(fused_parts(name))]


def torch_pair(
    job: JobConfig,
    adamw_params: dict[str, torch.nn.Parameter],
    muon_leaves: list[torch.nn.Parameter],
    **adamw_options: Any,
) -> tuple[torch.optim.AdamW, torch.optim.Muon]:
    """torch.optim.AdamW over `adamw_params` (llmtrain's decay groups; `adamw_options` such as fused) and
    torch.optim.Muon over `muon_leaves` (2-D leaves: muon_blocks of each Muon parameter), from the job's
    hyperparameters."""
    t = job.train
    decay = [p for n, p in adamw_params.items() if not no_weight_decay(n, p)]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": [p for n, p in adamw_params.items() if no_weight_decay(n, p)], "weight_decay": 0.0},
    ]
    betas = (t.adam_beta1, t.adam_beta2)
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps, **adamw_options)
    ref_muon = torch.optim.Muon(
        muon_leaves,
        lr=t.muon_lr or t.lr,
        weight_decay=t.weight_decay if t.muon_weight_decay is None else t.muon_weight_decay,
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_coefficients=tuple(t.muon_ns_coefficients),
        ns_steps=t.muon_ns_steps,
        adjust_lr_fn=t.muon_adjust_lr,
    )
    return adamw, ref_muon
