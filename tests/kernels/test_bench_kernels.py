"""benchmarks/bench_kernels.py: exits 0 with a message without a GPU; its harness runs end to end on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_gpu_says_so_and_exits_zero():
    out = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs a CUDA GPU" in out.stdout


@pytest.mark.slow
def test_smoke_run_covers_every_kernel():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, str(BENCH), "--smoke"], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for case in (
        "rms_norm",
        "layer_norm",
        "rotary",
        "swiglu",
        "flash_attention",
        "cross_entropy",
        "fused_linear_ce",
    ):
        assert f"== {case}" in out.stdout
    assert "failed" not in out.stdout, out.stdout
