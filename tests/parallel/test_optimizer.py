"""ModelOptimizer on one process: resuming from state_dict continues exactly (reference: the unbroken run)."""

from __future__ import annotations

import pytest
import torch

from llmtrain import models
from llmtrain.parallel import Topology, build_optimizer, parallelize
from tests.parallel._dist import batches, tiny_job


def _train(job, model, opt, data):
    for batch in data:
        opt.zero_grad()
        opt.backward(model(batch[:, :-1], batch[:, 1:]))
        opt.step(1e-3)


def _fresh(job):
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    parallelize(model, Topology.single(), job)
    return model, build_optimizer(model, Topology.single(), job)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_from_state_dict_matches_unbroken_run(precision: str) -> None:
    job = tiny_job("gpt", precision=precision)
    data = batches(job, 4)
    model, opt = _fresh(job)
    _train(job, model, opt, data)

    first, first_opt = _fresh(job)
    _train(job, first, first_opt, data[:2])
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = first_opt.state_dict()
    resumed, resumed_opt = _fresh(job)
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    _train(job, resumed, resumed_opt, data[2:])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0)
    assert resumed_opt.loss_scale == opt.loss_scale


def test_state_from_another_layout_is_refused() -> None:
    job = tiny_job("gpt")
    _, opt = _fresh(job)
    state = opt.state_dict()
    state["zero_stage"] = 1
    with pytest.raises(ValueError, match="zero_stage"):
        opt.load_state_dict(state)
