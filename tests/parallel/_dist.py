"""Helpers of the parallel tests: spawning a gloo process group and the runs being compared."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig
from llmtrain.parallel import Topology, build_optimizer, gather_full_state_dict, grad_sync, parallelize
from llmtrain.parallel.optimizer import no_weight_decay

ARCH_CONFIGS = {
    "gpt": dict(arch="gpt"),
    "llama": dict(arch="llama", num_kv_heads=2),  # GQA: kv heads split at tp=2, replicated at tp=4
    "ernie": dict(arch="ernie"),
}


def tiny_job(arch: str, **overrides: Any) -> JobConfig:
    """2 layers, hidden 64, vocab 128, seq 16: the shapes every multi-process test uses."""
    job = JobConfig(
        model=ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=128,
            seq_length=16,
            kernels="torch",
            **ARCH_CONFIGS[arch],
        )
    )
    job.train.global_batch_size = 8
    job.train.micro_batch_size = 2
    job.train.grad_clip = 0.5  # below the gradient norms these runs see, so clipping is exercised
    # Adam divides by sqrt(v) + eps: a gradient that is ~0 up to fp32 rounding (1e-10, its sign set by the
    # summation order, which TP changes) moves a weight by lr * g / eps. eps=1e-6 keeps that rounding-order
    # effect below 1e-7 so the 1e-5 comparison tests the layout, not the last bit of a cancellation.
    job.train.adam_eps = 1e-6
    job.parallel.dp_bucket_mb = 0.02  # several buckets even for this tiny model
    for key, value in overrides.items():
        section = next(c for c in (job.model, job.train, job.parallel) if hasattr(c, key))
        setattr(section, key, value)
    return job


def batches(job: JobConfig, steps: int, seed: int = 99, learnable: bool = False) -> list[torch.Tensor]:
    """The global batches of a run: (global_batch, seq + 1) token ids, uniform noise or counting sequences."""
    g = torch.Generator().manual_seed(seed)
    shape = (job.train.global_batch_size, job.model.seq_length + 1)
    vocab = job.model.vocab_size
    if learnable:  # each row counts up from a random start: a model can drive the loss towards 0
        starts = torch.randint(0, vocab, (steps, shape[0], 1), generator=g)
        return list((starts + torch.arange(shape[1])) % vocab)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(steps)]


def reference_run(
    job: JobConfig, steps: int, lr: float = 1e-3
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain model, torch.optim.AdamW and torch's clip_grad_norm_: the reference."""
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
    rest = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
    t = job.train
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
    )
    losses = []
    for batch in batches(job, steps):
        opt.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parallel_run(
    job: JobConfig, topo: Topology, steps: int, lr: float = 1e-3, learnable: bool = False
) -> dict[str, Any]:
    """Our stack on `topo`: this DP rank's slice of each global batch, accumulation over micro-batches."""
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    parallelize(model, topo, job)
    opt = build_optimizer(model, topo, job)
    t = job.train
    per_rank = t.global_batch_size // topo.dp
    micro = per_rank // t.micro_batch_size
    losses, stats = [], []
    for batch in batches(job, steps, learnable=learnable):
        mine = batch[topo.dp_rank * per_rank : (topo.dp_rank + 1) * per_rank]
        opt.zero_grad()
        total = 0.0
        for i, mb in enumerate(mine.split(t.micro_batch_size)):
            with grad_sync(model, i == micro - 1):
                loss = model(mb[:, :-1], mb[:, 1:]) / micro
                opt.backward(loss)
            total += loss.item()
        stats.append(opt.step(lr))
        value = torch.tensor([total / topo.dp], dtype=torch.float64)
        if topo.dp > 1:
            dist.all_reduce(value, group=topo.dp_group)
        losses.append(value.item())
    return {
        "losses": losses,
        "stats": stats,
        "state": gather_full_state_dict(model, topo),
        "model": model,
        "opt": opt,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A failing rank leaves the others waiting in a collective: fail within a minute, not gloo's 30.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
    except Exception:
        result = RuntimeError(f"rank {rank}:\n{traceback.format_exc()}")
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def spawn(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo processes; return each rank's (picklable) result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results
