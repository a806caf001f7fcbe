"""Multi-token prediction (model.mtp_layers) under every layout it combines with: tensor (+ sequence)
parallelism, context parallelism (labels shifted on the whole sequences), expert parallelism (an MoE
module block), pipeline parallelism (the modules on the last stage with its copy of the embedding, kept in
sync with the first stage's: 1f1b untied, interleaved with a tied head, zb_v's V with one shared embedding,
an MoE module block whose router statistics join the stages' pooled load-balancing table), ZeRO 1-3 and
recompute train like the float64 one-process run (tests/parallel/_reference.py), at most 4 processes by
combining them."""

from __future__ import annotations

import pytest

from tests.parallel._dist import spawn
from tests.parallel._reference import train_layouts

DEEPSEEK = dict(mtp_layers=1)  # its MTP block is an MoE layer (layer 2 >= moe_layer_start=1)
LLAMA = dict(mtp_layers=2)

# Each combination once: ZeRO-1 of the modules' parameters runs in the tp=2 dp=2 ep=2 layout (world 4), the
# untied 1f1b pipeline with its MTP block on the last stage in deepseek_v3's pp=2 (whose block is an MoE layer
# too), so neither has a 2-process llama launch of its own.
LAYOUTS = {
    2: [
        ("deepseek_v3", dict(tp=2, sequence_parallel=True, **DEEPSEEK), "sgd"),
        ("deepseek_v3", dict(cp=2, **DEEPSEEK), "adamw"),
        ("deepseek_v3", dict(ep=2, zero_stage=3, recompute="full", **DEEPSEEK), "sgd"),
        ("llama", dict(tp=2, recompute="selective", **LLAMA), "adamw"),
        (
            "llama",
            dict(
                pp=2,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                num_layers=4,
                tie_word_embeddings=True,
                **LLAMA,
            ),
            "sgd",
        ),  # fmt: skip
        ("deepseek_v3", dict(pp=2, **DEEPSEEK), "sgd"),
        # A V: the first and last stage on rank 0, one embedding shared by its two chunks.
        ("llama", dict(pp=2, schedule="zb_v", virtual_stages=2, num_layers=4, mtp_layers=1), "adamw"),
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
