"""ZeRO-3 with the float8 weight all-gather (train.fp8_all_gather): the traced step against the planner.

One training step of a tiny llama at dp=2, zero_stage=3, precision=fp8 is traced on gloo (tests/planner/
_trace.py, through test_collectives' machinery: FSDP2's gathers are the shard exchange's sends there) and
compared with CostModel.collectives exactly, as test_collectives compares every other FSDP2 layout. Apart
from the planner, each block's gather is checked against the model itself: its float8 linears' weights at
1 byte an element and its norms at bf16's 2, so a gather that fell back to bf16 (2 bytes a weight) or fp32
(4) fails both checks.
"""

from __future__ import annotations

import importlib.util

import pytest
from torch import nn

from llmtrain import models
from llmtrain.planner import CostModel, Workload, load_cluster
from llmtrain.planner.cost.collectives import FLOAT8_SCALE_BYTES, Comm
from llmtrain.planner.cost.layout import layout_of_job
from llmtrain.planner.report.explain import part_kinds
from tests.parallel._dist import SpawnedCases, tiny_job
from tests.planner.test_collectives import _check, _traced_step

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")

DP = 2
OVERRIDES = dict(precision="fp8", dp=DP, zero_stage=3)


@pytest.fixture(scope="module")
def traced() -> SpawnedCases:
    return SpawnedCases(_traced_step, {"fp8-zero3": (DP, ("llama", OVERRIDES))})


def _block_gather_bytes(fp8: bool) -> int:
    """One block's shard sent to the peer in each all-gather: its linear weights at 1 byte (float8) or
    2 (bf16), every other parameter (the norms) at 2, divided over the DP ranks."""
    block = models.empty_model(tiny_job("llama", **OVERRIDES).model, device="meta").layers[0]
    linear = sum(m.weight.numel() for m in block.modules() if type(m) is nn.Linear)
    rest = sum(p.numel() for p in block.parameters()) - linear
    return (linear * (1 if fp8 else 2) + 2 * rest) // DP


@needs_torchao
@pytest.mark.slow
def test_fp8_all_gather_moves_one_byte_a_weight(traced: SpawnedCases) -> None:
    ranks = traced("fp8-zero3")
    num_layers = tiny_job("llama").model.num_layers
    fp8, bf16 = _block_gather_bytes(True), _block_gather_bytes(False)
    for _, counts in ranks:
        sends = {c.nbytes: n for c, n in counts.items() if c.op == "send"}
        # Each block gathered in its forward and again in its backward (zero 3), per micro-batch.
        assert sends.get(fp8, 0) >= 2 * num_layers, (fp8, sorted(sends.items()))
        assert bf16 not in sends, (bf16, sorted(sends.items()))
        # One fp32 all-reduce (MAX) of every float8 weight's amax a step: 6 linears a block.
        assert counts[Comm("all_reduce", "dp", DP, 4 * 6 * num_layers)] == 1, sorted(counts.items(), key=str)


@needs_torchao
@pytest.mark.slow
def test_planner_counts_the_fp8_all_gather(traced: SpawnedCases) -> None:
    _check(traced("fp8-zero3"), "llama", DP, OVERRIDES, bucket_slack=None)


def test_planner_prices_and_names_the_fp8_all_gather() -> None:
    """On an H100 node: the float8 gathers cost less time and gathered memory than bf16 ones, and the
    --evaluate report's DP line says the weights travel in float8."""
    estimates = {}
    for wanted in (None, False):
        job = tiny_job("llama", **OVERRIDES, fp8_all_gather=wanted)
        view = load_cluster("h100-80gb").view(DP)
        estimates[wanted] = CostModel(Workload.from_job(job), view).evaluate(layout_of_job(job, DP))
    on, off = estimates[None], estimates[False]
    assert on.float8_gather and not off.float8_gather
    # The gathers cost less; the step adds the scales' all-reduce (6 float8 linears a layer, 4 bytes each),
    # whose latency outweighs the bytes saved at these tiny shapes.
    scales = view.all_reduce(job.model.num_layers * 6 * FLOAT8_SCALE_BYTES, DP, 1)
    assert on.dp_comm - scales < off.dp_comm < on.dp_comm
    assert on.memory["gathered"] < off.memory["gathered"]
    assert "in float8" in part_kinds(on.layout, view, on.float8_gather)["dp"]
    assert "float8" not in part_kinds(off.layout, view, off.float8_gather)["dp"]
