"""Shared pieces of the checkpoint tests: a tiny job, a training loop, a trained tokenizer, and signals to a
launch's processes."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import psutil
import torch

from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig
from llmtrain.data.tokenizer import train_sentencepiece
from llmtrain.parallel import Topology, build_optimizer, grad_sync, parallelize


def tiny_job(out: Path | str, arch: str = "llama", **overrides: Any) -> JobConfig:
    """2 layers, hidden 32, vocab 64, seq 8, dropout on (RNG matters); overrides as section__key=value."""
    job = JobConfig(
        model=ModelConfig(
            arch=arch,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_kv_heads=2,
            vocab_size=64,
            seq_length=8,
            kernels="torch",
            hidden_dropout=0.1,
        ),
        output_dir=str(out),
    )
    job.train.global_batch_size = 4
    job.train.micro_batch_size = 2
    job.parallel.dp_bucket_mb = 0.005  # several buckets, so ZeRO ranges split parameters
    for key, value in overrides.items():
        section, field = key.split("__")
        setattr(getattr(job, section), field, value)
    return job


def build(job: JobConfig, topo: Topology) -> tuple[torch.nn.Module, Any]:
    """Model and ModelOptimizer as tools/pretrain builds them."""
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    if job.train.precision == "bf16":
        model = model.to(torch.bfloat16)
    parallelize(model, topo, job)
    return model, build_optimizer(model, topo, job)


def batch(job: JobConfig, step: int) -> torch.Tensor:
    """The global batch of `step` (a pure function of the step, like the data loader's)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(
        0, job.model.vocab_size, (job.train.global_batch_size, job.model.seq_length + 1), generator=g
    )


def train(
    job: JobConfig, topo: Topology, model: torch.nn.Module, opt: Any, first: int, last: int
) -> list[float]:
    """Steps first+1..last on this rank's slice of each global batch; returns this rank's losses."""
    per_rank = job.train.global_batch_size // topo.dp
    losses = []
    for step in range(first, last):
        mine = batch(job, step)[topo.dp_rank * per_rank : (topo.dp_rank + 1) * per_rank]
        opt.zero_grad()
        micro = mine.split(job.train.micro_batch_size)
        total = 0.0
        for i, mb in enumerate(micro):
            with grad_sync(model, i == len(micro) - 1):
                loss = model(mb[:, :-1], mb[:, 1:]) / len(micro)
                opt.backward(loss)
            total += loss.item()
        opt.step(1e-2)
        losses.append(total)
    return losses


def stdlib_texts(first: int, count: int) -> list[str]:
    """`count` whole modules of the standard library from the `first`-th in sorted order: real code and
    prose (docstrings, comments) for training and checking tokenizers."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 60_000)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[first : first + count]]


def train_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """A byte-fallback BPE SentencePiece model as tools/train_tokenizer.py trains it, on 40 stdlib modules."""
    return train_sentencepiece(stdlib_texts(0, 40), path, vocab_size)


def signal_all(processes: list[psutil.Process], signum: int) -> None:
    """Send `signum` to each of `processes` still alive (a data-loader worker may end meanwhile)."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signum)


def kill_launch(launch: subprocess.Popen) -> None:
    """SIGKILL a launch that is still running with every process under it: the launcher first, so that it
    restarts no worker, then its workers and theirs, which torchrun starts in sessions of their own and which
    would otherwise outlive the test holding its ports and cores."""
    if launch.poll() is not None:
        return
    try:
        tree = psutil.Process(launch.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    launch.kill()
    signal_all(tree, signal.SIGKILL)
    launch.wait()
