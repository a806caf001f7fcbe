"""parallel.dp_reduce=tree: the pairwise sum's order and the layouts that refuse it. The gradient bits it
gives across data-parallel sizes are checked end to end by tests/training/test_raw_data_resume.py."""

from __future__ import annotations

import pytest
import torch

from llmtrain.config import ConfigError, JobConfig, validate
from llmtrain.parallel.data_parallel import pairwise_sum


def test_pairwise_sum_is_the_balanced_tree_in_order() -> None:
    g = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    tree = (g[0] + g[1]) + (g[2] + g[3])
    assert torch.equal(pairwise_sum(g[:4]), tree)
    assert not torch.equal(tree, ((g[0] + g[1]) + g[2]) + g[3])  # fp32: the order shows in the bits
    assert torch.equal(pairwise_sum(g), tree + g[4])  # an odd row joins at the next level
    # 2 ranks holding g0+g1 and g2+g3 (two micro-batches each) sum to 4 ranks' one each, bit for bit.
    assert torch.equal(pairwise_sum(torch.stack([g[0] + g[1], g[2] + g[3]])), tree)


@pytest.mark.parametrize(("stage", "engine"), [(1, "llmtrain"), (2, "llmtrain"), (1, "deepspeed")])
def test_tree_reduction_needs_zero_stage_0_of_llmtrain(stage: int, engine: str) -> None:
    job = JobConfig()
    job.parallel.dp_reduce, job.parallel.zero_stage, job.parallel.engine = "tree", stage, engine
    with pytest.raises(ConfigError, match="parallel.dp_reduce=tree sums whole gradient buffers"):
        validate(job)
