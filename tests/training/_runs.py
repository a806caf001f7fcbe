"""Tiny jobs of tools/pretrain.py for the lifecycle tests: in-process and as real subprocesses.

The model is small enough that a step takes milliseconds; the data is the default corpus, cached by the
first test that needs it, so each run takes a few seconds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.parallel._dist import free_port

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "tools" / "pretrain.py"
CONFIG = ROOT / "configs" / "ernie.yaml"

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.eval_batches=1",
    "train.num_threads=1",
    "logging.tensorboard=false",
]


def pretrain_args(out: Path, *overrides: str) -> list[str]:
    """Arguments of tools/pretrain.py for the tiny job writing to `out`."""
    return [str(PRETRAIN), "--config", str(CONFIG), *TINY, f"output_dir={out}", *overrides]


def python_command(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, *pretrain_args(out, *overrides)]


def torchrun_command(nproc: int, out: Path, *overrides: str) -> list[str]:
    port = free_port()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        *pretrain_args(out, *overrides),
    ]


def env() -> dict[str, str]:
    """The test's environment without a debug switch or torchrun's shared-store opt-out (the tests check
    what users see by default)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("LLMTRAIN_DEBUG", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    }


def run_cli(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=timeout)


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under `path` (relative name -> SHA-256 of its bytes): a snapshot to compare against."""
    if not path.exists():
        return {}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def train_here(out: Path, *overrides: str) -> None:
    """The tiny job of `python_command(out, *overrides)` run to its end in this process, through
    llmtrain.training.run (what tools/pretrain.py calls): for a reference run whose launch is not what a
    test checks, without starting Python, torch and llmtrain again (~8 CPU-s)."""
    from llmtrain.config import load
    from llmtrain.training.run import run

    result = run(load(CONFIG, [*TINY, f"output_dir={out}", *overrides]))
    assert result.exit_code == 0, result.summary()
