"""train.compile=blocks: each transformer block compiled (llmtrain.parallel.compile_blocks), the same
training as uncompiled.

Reference: the uncompiled run of the same job. fp32 on CPU: Inductor fuses the blocks' elementwise ops and
may reorder their fp32 reductions (the norms' sums of 64 squares, the softmax's), a few fp32 roundings per op
(relative 1e-7 each); after three AdamW steps the losses agree to 1e-5 relative, far below a wrong graph's
error (a dropped gradient term moves the loss at the second step by more than 1e-2 here).
"""

from __future__ import annotations

import pytest
import torch

from llmtrain import models
from llmtrain.config import ConfigError, load
from llmtrain.parallel import Topology, build_optimizer, parallelize
from tests.training._runs import TINY as RUN_TINY

TINY = [*RUN_TINY, "model.vocab_size=256", "model.recompute=selective", "train.lr=1e-2"]


def _losses(mode: str) -> tuple[list[float], torch.nn.Module]:
    torch._dynamo.reset()
    job = load("configs/llama-small.yaml", [*TINY, f"train.compile={mode}"])
    torch.manual_seed(job.train.seed)
    model = parallelize(models.build(job.model), Topology.single(), job)
    optimizer = build_optimizer(model, Topology.single(), job)
    tokens = torch.randint(0, job.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        optimizer.backward(loss)
        optimizer.step(job.train.lr)
        losses.append(loss.item())
    return losses, model


@pytest.mark.slow  # Inductor compiles the block on CPU (tens of seconds)
def test_compiled_blocks_train_as_uncompiled():
    eager, _ = _losses("none")
    compiled, model = _losses("blocks")
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert eager[0] != eager[-1]  # the steps moved the weights
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


LAYOUTS = [
    ["parallel.tp=2"],
    ["parallel.pp=2"],
    ["parallel.cp=2"],
    ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout[0])
def test_unverified_layouts_are_refused_naming_the_field(layout):
    with pytest.raises(ConfigError, match=r"train.compile=blocks .*train.compile=none"):
        load("configs/llama-small.yaml", [*layout, "train.compile=blocks"])
