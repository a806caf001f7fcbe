"""Multi-token prediction (model.mtp_layers) under every layout it combines with: tensor (+ sequence)
parallelism, context parallelism (labels shifted on the whole sequences), expert parallelism (an MoE
module block), ZeRO 1-3 and recompute train like the float64 one-process run (tests/parallel/_reference.py),
at most 4 processes by combining them."""

from __future__ import annotations

import pytest

from tests.parallel._dist import spawn
from tests.parallel._reference import train_layouts

DEEPSEEK = dict(mtp_layers=1)  # its MTP block is an MoE layer (layer 2 >= moe_layer_start=1)
LLAMA = dict(mtp_layers=2)

LAYOUTS = {
    2: [
        ("deepseek_v3", dict(tp=2, sequence_parallel=True, **DEEPSEEK), "sgd"),
        ("deepseek_v3", dict(cp=2, **DEEPSEEK), "adamw"),
        ("deepseek_v3", dict(ep=2, zero_stage=3, recompute="full", **DEEPSEEK), "sgd"),
        ("llama", dict(tp=2, recompute="selective", **LLAMA), "adamw"),
        ("llama", dict(zero_stage=1, **LLAMA), "sgd"),
    ],
    4: [
        ("deepseek_v3", dict(cp=2, dp=2, ep=2, zero_stage=2, **DEEPSEEK), "adamw"),
        ("deepseek_v3", dict(tp=2, dp=2, ep=2, sequence_parallel=True, zero_stage=1, **DEEPSEEK), "sgd"),
        ("llama", dict(tp=2, cp=2, sequence_parallel=True, recompute="full", **LLAMA), "sgd"),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_mtp_layouts_train_like_one_process(world: int) -> None:
    failures = [f for r in spawn(world, train_layouts, LAYOUTS[world]) for f in r]
    assert not failures, "\n".join(failures)
