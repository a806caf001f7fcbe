"""benchmarks/bench_kernels.py: exits 0 with a message without a GPU; its harness runs end to end on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


@pytest.mark.slow  # multi-second (3 s, a subprocess on two idle cores): runs in CI, not in -m 'not slow'
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


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_kernels", bench)  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    return sys.modules["bench_kernels"]


def test_measure_on_cpu_times_with_the_wall_clock_and_builds_the_gradient_once():
    bench = _bench_module()
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    calls = []

    def fn(a, b):
        calls.append(1)
        return a * b

    t = bench.measure(fn, [x, w], "cpu", reps=3)
    assert t.method == "wall clock" and t.note == ""
    assert t.fwd > 0 and t.fwd_bwd > 0 and (t.eager_fwd, t.eager_fwd_bwd) == (t.fwd, t.fwd_bwd)
    assert t.peak != t.peak  # nan: no peak memory on CPU
    assert x.grad is None and w.grad is None  # gradients are returned, never accumulated
    assert len(calls) == 1 + 2 + 3 + 3  # first call, 2 warm-up steps, 3 forward reps, 3 step reps


@pytest.mark.slow
def test_peers_dry_run_rows_carry_the_timing_method(tmp_path):
    peers = BENCH.parent / "gpu" / "bench_kernels_peers.py"
    out = tmp_path / "k.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run(
        [sys.executable, str(peers), "--dry-run", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=600,
        env=env,
    )
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert r["timing"] == "wall clock" and r["eager_fwd_bwd_ms"] > 0 and r["eager_fwd_ms"] > 0
        if "fwd_bwd_gbps" in r:
            assert r["fwd_gbps"] > 0 and r["fraction_of_bandwidth"] > 0
