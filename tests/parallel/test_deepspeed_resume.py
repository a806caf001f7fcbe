"""parallel.engine=deepspeed resumes from llmtrain's layout-free checkpoints, its own and llmtrain's, and
llmtrain resumes from its checkpoints (2 gloo processes, the tiny gpt of tests/parallel/_dist.py).

References: uninterrupted runs. Same engine and layout (DeepSpeed ZeRO-2 fp32, ZeRO-1 bf16): the checkpoint
restores bitwise what the run held (fp32 masters, Adam's moments and step; bf16 weights are the masters'
cast), so the resumed losses equal the straight run's exactly. Across engines the reference is the straight
run of another fp32 layout: the engines and layouts sum the same numbers in other orders (each lies within
the float64 reference's fp32 bounds, test_deepspeed.py), ~1e-7 relative in the losses after 6 Adam steps;
1e-5 relative (the bound of tests/checkpoint/test_reshard.py) leaves room for that and fails a resume that
dropped Adam's moments or step (a 1e-3-size move of the weights here, ~1e-3 in the next loss). The Hugging
Face export of the DeepSpeed ZeRO-3 checkpoint is checked against transformers' logits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmtrain import models
from llmtrain.checkpoint import Checkpointer
from llmtrain.config import JobConfig
from llmtrain.parallel import Topology, build_optimizer, grad_sync, parallelize
from llmtrain.training.profiling import StepTimer
from llmtrain.training.trainer import LocalStepRunner
from tests.parallel._dist import batches, spawn, tiny_job

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="pip install 'llmtrain[deepspeed]'"
    ),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

LR = 1e-3
STEPS = 6
HALF = STEPS // 2


def _job(
    out: Path,
    world: int,
    zero_stage: int,
    engine: str = "llmtrain",
    offload: str = "none",
    precision: str = "fp32",
) -> JobConfig:
    job = tiny_job("gpt", dp=world, zero_stage=zero_stage, engine=engine, offload=offload)
    job.train.precision = precision
    job.output_dir = str(out)
    return job


class _Run:
    """One engine and layout as the trainer assembles it, driven as the trainer drives it, with its
    Checkpointer."""

    def __init__(self, job: JobConfig, rank: int, world: int) -> None:
        self.topo = Topology(job.parallel, world, rank)
        torch.manual_seed(job.train.seed)
        micro = job.train.micro_batch_size
        if job.parallel.engine == "deepspeed":
            from llmtrain.parallel.deepspeed_engine import build_deepspeed
            from llmtrain.parallel.deepspeed_engine import grad_sync as deepspeed_grad_sync

            engine, self.opt = build_deepspeed(models.build(job.model), self.topo, job)
            self.model = engine.module
            self.runner = LocalStepRunner(engine, self.opt, micro, deepspeed_grad_sync)
        else:
            self.model = parallelize(models.build(job.model), self.topo, job)
            self.opt = build_optimizer(self.model, self.topo, job)
            self.runner = LocalStepRunner(self.model, self.opt, micro, grad_sync)
        self.job = job
        self.ck = Checkpointer(job, self.topo)

    def train(self, data: list[torch.Tensor]) -> list[float]:
        """Losses (mean over DP) of one step per global batch."""
        losses = []
        for batch in data:
            self.opt.zero_grad()
            loss = self.runner.train_step(batch.chunk(self.topo.dp)[self.topo.dp_rank], StepTimer(False))
            loss = loss.double() / self.topo.dp
            dist.all_reduce(loss)
            losses.append(loss.item())
            self.opt.apply(LR, self.opt.prepare())
        return losses

    def save(self, step: int) -> None:
        self.ck.save(step, self.model, self.opt, {"step": step})

    def load(self, out: Path) -> None:
        assert self.ck.load(out, self.model, self.opt) == {"step": HALF}


def _gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _full_weights(run: _Run, zero_stage: int) -> dict[str, torch.Tensor]:
    """The DeepSpeed run's full weights (gathered at ZeRO-3), as the single-process model names them."""
    import deepspeed

    params = list(run.model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def _hf_export_matches(saved: Path, weights: dict[str, torch.Tensor], job: JobConfig, out: Path) -> None:
    """tools/convert_checkpoint.py llmtrain-to-hf of `saved`, loaded by transformers, gives the logits of
    our model holding `weights` (within test_conversion.py's fp32 tolerance for two implementations)."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_conversion import TOL
    from tools import convert_checkpoint

    assert convert_checkpoint.main(["llmtrain-to-hf", "--input", str(saved), "--output", str(out)]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = models.build(job.model)
    ours.load_state_dict(weights)
    ids = batches(job, 1)[0][:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, ours.eval()(ids), **TOL)


def _resumes(rank: int, world: int, tmp: str) -> dict[str, float]:
    root = Path(tmp)
    data = batches(tiny_job("gpt"), STEPS)
    first, rest = data[:HALF], data[HALF:]

    def straight_saving(name: str, **layout) -> list[float]:
        """Losses of steps HALF+1..STEPS of a run of `layout` that saves after step HALF."""
        run = _Run(_job(root / name, world, **layout), rank, world)
        run.train(first)
        run.save(HALF)
        return run.train(rest)

    def resumed(saved: str, **layout) -> list[float]:
        run = _Run(_job(root / f"resumed_{saved}", world, **layout), rank, world)
        run.load(root / saved)
        return run.train(rest)

    # Same engine and layout: DeepSpeed ZeRO-2 3 steps, saved, resumed by a new engine for 3 more.
    zero2 = dict(zero_stage=2, engine="deepspeed")
    ds_zero2 = straight_saving("ds_zero2", **zero2)
    got = resumed("ds_zero2", **zero2)
    assert got == ds_zero2, f"DeepSpeed zero2 resumed {got} != straight {ds_zero2}"
    # ... and ZeRO-1 in bf16, whose bf16 weights are restored as the cast of the fp32 masters.
    zero1_bf16 = dict(zero_stage=1, engine="deepspeed", precision="bf16")
    want, got = straight_saving("ds_zero1_bf16", **zero1_bf16), resumed("ds_zero1_bf16", **zero1_bf16)
    assert got == want, f"DeepSpeed zero1 bf16 resumed {got} != straight {want}"
    # llmtrain ZeRO-3 (FSDP2) saves; DeepSpeed ZeRO-2 and ZeRO-3 (with the optimizer on the CPU) resume.
    llmtrain_zero3 = straight_saving("llmtrain_zero3", zero_stage=3)
    gaps = {
        "llmtrain zero3 -> deepspeed zero2": _gap(resumed("llmtrain_zero3", **zero2), ds_zero2),
        "llmtrain zero3 -> deepspeed zero3 offload=optimizer": _gap(
            resumed("llmtrain_zero3", zero_stage=3, engine="deepspeed", offload="optimizer"), ds_zero2
        ),
    }
    # DeepSpeed ZeRO-3 with the optimizer and parameters on the CPU saves; llmtrain ZeRO-1 resumes, and
    # its checkpoint exports to Hugging Face.
    offload = dict(zero_stage=3, engine="deepspeed", offload="optimizer+params")
    run = _Run(_job(root / "ds_zero3_offload", world, **offload), rank, world)
    run.train(first)
    run.save(HALF)
    weights = _full_weights(run, 3)
    gaps["deepspeed zero3 offload -> llmtrain zero1"] = _gap(
        resumed("ds_zero3_offload", zero_stage=1), llmtrain_zero3
    )
    if rank == 0:
        _hf_export_matches(root / "ds_zero3_offload", weights, run.job, root / "hf")
    return gaps


@pytest.mark.slow
def test_deepspeed_resumes_like_a_straight_run(tmp_path, deepspeed_extensions):
    """See the module docstring: exact on the same engine and layout, 1e-5 relative across engines; the
    Hugging Face export of a DeepSpeed ZeRO-3 checkpoint loads in transformers with the saved weights."""
    gaps = spawn(2, _resumes, str(tmp_path))[0]
    print("\n".join(f"{name}: worst relative loss gap {gap:.2e}" for name, gap in gaps.items()))
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps
