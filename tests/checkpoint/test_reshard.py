"""Checkpoints load on any layout over gloo (4 processes).

References: training continued on the layout that saved (losses within 1e-5 relative, fp32), the saved
tensors themselves (a checkpoint re-saved on another layout holds bitwise the same model and optimizer
state), the parallel package's gather_full_state_dict (full weights, also those llmtrain.from_pretrained
reads from the checkpoint), the uninterrupted run (exact resume on the same layout), and transformers'
logits and loss (a converted checkpoint loaded tp=2 and tp=2 pp=2).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import llmtrain
from llmtrain import models
from llmtrain.checkpoint import Checkpointer
from llmtrain.checkpoint.convert import from_hf, read_full
from llmtrain.checkpoint.manager import read_meta, resolve
from llmtrain.config import ModelConfig
from llmtrain.parallel import (
    Topology,
    apply_tp,
    build_optimizer,
    gather_full_state_dict,
    grad_sync,
    parallelize,
)
from llmtrain.pipeline.executor import PipelineExecutor
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.stages import activation_shape, build_stages
from tests.checkpoint._util import batch, tiny_job
from tests.parallel._dist import free_port, start_ranks

WORLD = 4
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Run:
    """One layout's model (or pipeline stages), optimizer and step function, as the trainer builds them."""

    def __init__(
        self,
        out: Path,
        rank: int,
        tp: int,
        pp: int,
        dp: int,
        zero: int,
        sp: bool = False,
        model: Any = None,
        async_save: bool = False,
        cp: int = 1,
    ) -> None:
        self.job = tiny_job(
            out, "ernie", model__hidden_dropout=0.0, model__num_layers=4, parallel__tp=tp, parallel__pp=pp,
            parallel__dp=dp, parallel__zero_stage=zero, parallel__sequence_parallel=sp, parallel__cp=cp,
            train__global_batch_size=8, checkpoint__async_save=async_save,
        )  # fmt: skip
        job = self.job
        if model is not None:
            job.model = model
        self.topo = Topology(job.parallel, WORLD, rank)
        torch.manual_seed(job.train.seed)
        model = models.build(job.model)
        if pp == 1:
            self.model = parallelize(model, self.topo, job)
            self.executor = None
        else:
            apply_tp(model, self.topo, sp, job.train.seed)
            self.model = build_stages(model, self.topo, sequence_parallel=sp)
            micro = job.train.micro_batch_size
            m = job.train.global_batch_size // (micro * dp)
            shape = activation_shape(micro, job.model.seq_length, job.model.hidden_size, tp, sp)
            self.executor = PipelineExecutor(self.model, build_schedule("1f1b", pp, m), self.topo, shape)
        self.opt = build_optimizer(self.model, self.topo, job)
        self.ck = Checkpointer(job, self.topo)

    def train(self, first: int, last: int) -> list[float]:
        """Global-batch mean losses of steps first..last-1 (the same on every rank)."""
        t, topo = self.job.train, self.topo
        losses = []
        for step in range(first, last):
            local = batch(self.job, step).chunk(topo.dp)[topo.dp_rank]
            micro = list(local.split(t.micro_batch_size))
            if self.executor is not None:
                loss = self.executor.run(micro)
            else:
                loss = torch.zeros(())
                for i, mb in enumerate(micro):
                    with grad_sync(self.model, i == len(micro) - 1):
                        part = self.model(mb[:, :-1], mb[:, 1:]) / len(micro)
                        self.opt.backward(part)
                    loss += part.detach()
            self.opt.step(1e-2)
            self.opt.zero_grad()
            if topo.dp > 1:
                dist.all_reduce(loss, group=topo.dp_group)
                loss /= topo.dp
            losses.append(loss.item())
        return losses

    def full_weights(self) -> dict[str, torch.Tensor]:
        chunks = self.model.chunks if self.executor is not None else [self.model]
        out: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            out.update(gather_full_state_dict(chunk, self.topo))
        return out


# (tp, pp, dp, zero_stage): the saving layout first, then those that load it.
SAVE = (2, 2, 1, 0)
LOADS = [(1, 1, 4, 1), (4, 1, 1, 0), (1, 2, 2, 1), (2, 1, 2, 1)]


def _reshard(rank: int, tmp: str) -> None:
    root = Path(tmp)
    a = Run(root / "a", rank, *SAVE)
    a.train(0, 2)
    a.ck.save(2, a.model, a.opt, {"step": 2})
    expected = a.train(2, 4)
    for tp, pp, dp, zero in LOADS:
        b = Run(root / f"b{tp}{pp}{dp}", rank, tp, pp, dp, zero)
        b.ck.load(root / "a", b.model, b.opt)
        b.ck.save(2, b.model, b.opt, {"step": 2})  # the same state, written by this layout
        got = b.train(2, 4)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=f"losses after loading {SAVE} at {(tp, pp, dp, zero)}")  # fmt: skip
    # ... and back: the original layout loads what the others wrote and continues identically.
    back = Run(root / "back", rank, *SAVE)
    back.ck.load(root / "b122" / "checkpoints", back.model, back.opt)
    torch.testing.assert_close(torch.tensor(back.train(2, 4)), torch.tensor(expected), rtol=1e-5, atol=0)
    dist.barrier()
    if rank == 0:
        original = read_full(root / "a" / "checkpoints")
        for tp, pp, dp, _ in LOADS:
            again = read_full(root / f"b{tp}{pp}{dp}" / "checkpoints")
            assert original.keys() == again.keys()
            for key, value in original.items():
                assert torch.equal(value, again[key]), (
                    f"{key} differs after a round trip through {(tp, pp, dp)}"
                )


def _exact_resume_and_full_weights(rank: int, tmp: str) -> None:
    """Async save under TP+SP+ZeRO-1: training (and its collectives) goes on while the save is written."""
    root = Path(tmp)
    run = Run(root / "r", rank, 2, 1, 2, 1, sp=True, async_save=True)
    run.train(0, 2)
    saved = run.full_weights()
    run.ck.save(2, run.model, run.opt, {"step": 2})
    expected = run.train(2, 4)
    run.ck.close()
    fresh = Run(root / "r", rank, 2, 1, 2, 1, sp=True)
    fresh.ck.load(fresh.ck.resume_path(), fresh.model, fresh.opt)
    for name, value in fresh.full_weights().items():
        assert torch.equal(value, saved[name]), name
    assert fresh.train(2, 4) == expected  # bitwise
    if rank == 0:
        on_disk = read_full(root / "r" / "checkpoints", prefix="model.")
        for name, value in saved.items():
            if name != "lm_head.weight":  # tied: stored once, as embed_tokens.weight
                assert torch.equal(on_disk[name], value), name
        # The checkpoint of this 4-rank TP+SP+ZeRO-1 layout loads as one model holding the gathered weights.
        loaded = llmtrain.from_pretrained(root / "r").state_dict()
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


def _worker(rank: int, port: int, fn: Any, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fn(rank, tmp)
        result = None
    except Exception:
        result = f"rank {rank}:\n{traceback.format_exc()}"
    Path(tmp, f"result.{rank}").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def _spawn(fn: Any, prepare: Any) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp)
        start_ranks(_worker, (port, fn, tmp), WORLD)
        errors = [pickle.loads(Path(tmp, f"result.{r}").read_bytes()) for r in range(WORLD)]
    errors = [e for e in errors if e]
    assert not errors, "\n".join(errors)


def _hf_checkpoint_matches_transformers(rank: int, tmp: str) -> None:
    """A transformers model converted for tp=2 pp=2 gives transformers' logits and loss when sharded."""
    root = Path(tmp)
    ref = torch.load(root / "hf_reference.pt")
    cfg = ModelConfig(**read_meta(resolve(root / "converted"))["model"])
    cfg.kernels, cfg.seq_length = "torch", ref["ids"].shape[1] - 1
    tp_run = Run(root / "tp", rank, 2, 1, 2, 0, model=cfg)
    tp_run.ck.load(root / "converted", tp_run.model, None)
    with torch.no_grad():
        local = tp_run.model(ref["ids"][:2, :-1])  # this TP rank's vocabulary slice of the logits
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local, group=tp_run.topo.tp_group)
    torch.testing.assert_close(torch.cat(parts, -1), ref["logits"][:2, :-1], atol=1e-5, rtol=1e-5)
    pp_run = Run(root / "pp", rank, 2, 2, 1, 0, model=cfg)
    pp_run.ck.load(root / "converted", pp_run.model, None)
    loss = pp_run.executor.evaluate(list(ref["ids"].split(2)))
    torch.testing.assert_close(loss, ref["loss"], atol=1e-5, rtol=1e-5)


def _prepare_hf(tmp: str) -> None:
    """Parent: a random transformers llama (GQA, untied), its outputs, and its tp=2 pp=2 conversion."""
    from tests.models.hf_models import hf_model

    root = Path(tmp)
    ref = hf_model("llama", 0)
    ref.save_pretrained(root / "hf")
    ids = torch.randint(0, ref.config.vocab_size, (8, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ref(input_ids=ids, labels=ids)
    torch.save({"ids": ids, "logits": out.logits, "loss": out.loss}, root / "hf_reference.pt")
    from_hf(root / "hf", root / "converted", tp=2, pp=2)


def _all(rank: int, tmp: str) -> None:
    _reshard(rank, tmp)
    _exact_resume_and_full_weights(rank, tmp)
    _hf_checkpoint_matches_transformers(rank, tmp)


@pytest.mark.slow
def test_any_layout_loads_any_checkpoint() -> None:
    # One spawn for every case: process start-up dominates on a shared CPU.
    _spawn(_all, _prepare_hf)
