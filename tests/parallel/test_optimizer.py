"""ModelOptimizer on one process: resuming continues exactly (reference: the unbroken run), through its own
state_dict and through a checkpoint, with torch's AdamW and with an optimizer that counts Adam's steps per
param group as Apex's FusedAdam does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmtrain import models
from llmtrain.checkpoint import Checkpointer
from llmtrain.parallel import Topology, build_optimizer, parallelize
from tests.parallel._dist import batches, tiny_job


class ApexStyleAdamW(torch.optim.Optimizer):
    """AdamW keeping its step count as apex.optimizers.FusedAdam does (apex/optimizers/fused_adam.py, read
    for this): one ``group["step"]`` per param group, set to 1 or incremented at the start of every step()
    and used for the bias correction; per-parameter state holds exp_avg and exp_avg_sq only. The update is
    written out in torch so it runs on CPU, where Apex's CUDA kernels cannot."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        assert adam_w_mode, "ModelOptimizer asks for decoupled weight decay"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(defaults, bias_correction=bias_correction))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            corr1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            corr2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m / corr1, (v / corr2).sqrt_().add_(group["eps"]), value=-group["lr"])


def _apex_style(job):
    t = job.train
    return lambda groups: ApexStyleAdamW(
        groups, adam_w_mode=True, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps
    )


def _train(job, model, opt, data):
    for batch in data:
        opt.zero_grad()
        opt.backward(model(batch[:, :-1], batch[:, 1:]))
        opt.step(1e-3)


def _fresh(job, make_optimizer=None):
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    parallelize(model, Topology.single(), job)
    return model, build_optimizer(model, Topology.single(), job, make_optimizer)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)


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
    _assert_same_weights(model, resumed)
    assert resumed_opt.loss_scale == opt.loss_scale


@pytest.mark.parametrize("through", ["state_dict", "checkpoint"])
def test_per_group_step_count_survives_resume(tmp_path: Path, through: str) -> None:
    """Bias correction continues after a resume when the step count lives in the param groups (Apex)."""
    job = tiny_job("gpt")
    job.output_dir = str(tmp_path)
    data = batches(job, 4)
    model, opt = _fresh(job, _apex_style(job))
    assert isinstance(opt.optimizer, ApexStyleAdamW)
    _train(job, model, opt, data)

    first, first_opt = _fresh(job, _apex_style(job))
    _train(job, first, first_opt, data[:2])
    resumed, resumed_opt = _fresh(job, _apex_style(job))
    if through == "state_dict":
        saved_model = {k: v.clone() for k, v in first.state_dict().items()}
        saved_opt = first_opt.state_dict()
        resumed.load_state_dict(saved_model)
        resumed_opt.load_state_dict(saved_opt)
    else:
        checkpointer = Checkpointer(job, Topology.single())
        checkpointer.save(2, first, first_opt, {"step": 2})
        checkpointer.load(checkpointer.resume_path(), resumed, resumed_opt)
    assert [g["step"] for g in resumed_opt.optimizer.param_groups] == [2, 2]
    _train(job, resumed, resumed_opt, data[2:])
    assert [g["step"] for g in resumed_opt.optimizer.param_groups] == [4, 4]
    _assert_same_weights(model, resumed)


def test_state_from_another_layout_is_refused() -> None:
    job = tiny_job("gpt")
    _, opt = _fresh(job)
    state = opt.state_dict()
    state["zero_stage"] = 1
    with pytest.raises(ValueError, match="zero_stage"):
        opt.load_state_dict(state)
