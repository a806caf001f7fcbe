"""benchmarks/bench_kernels.py: exits 0 with a message without a GPU; its harness runs end to end on CPU.

The scripts run through their main() in this process where its kernels are the interpreted ones the smoke
runs need (always without CUDA): a subprocess would import torch and Triton again for nothing the tests check.
With a GPU the smoke runs stay subprocesses under TRITON_INTERPRET=1, as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import INTERPRETED

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
PEERS = BENCH.parent / "gpu" / "bench_kernels_peers.py"


@functools.cache
def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return sys.modules[path.stem]


def _bench_module():
    return _load(BENCH)


def _smoke(script: Path, *args: str) -> str:
    """The stdout of `script args` on CPU with interpreted kernels, which must exit 0: main() here, or a
    subprocess under TRITON_INTERPRET=1 where this process compiles the kernels for a GPU."""
    if INTERPRETED:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = _load(script).main(list(args))
        assert status == 0, out.getvalue()[-2000:]
        return out.getvalue()
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow  # multi-second: runs in CI, not in -m 'not slow'
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_gpu_says_so_and_exits_zero(capsys):
    assert _bench_module().main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_run_covers_every_kernel():
    stdout = _smoke(BENCH, "--smoke")
    for case in (
        "rms_norm",
        "layer_norm",
        "rotary",
        "swiglu",
        "flash_attention",
        "cross_entropy",
        "fused_linear_ce",
    ):
        assert f"== {case}" in stdout
    assert "failed" not in stdout, stdout


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
def test_peers_dry_run_rows_carry_the_timing_method(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ and gpu/ in front
    out = tmp_path / "k.json"
    # Two kernels, one rated in FLOP/s and one in GB/s (a fraction of the measured copy bandwidth): the
    # peers script's own logic (bandwidth, the two kinds of rows, --kernels, the JSON) is the same for
    # every kernel, and test_smoke_run_covers_every_kernel runs the harness on all seven. No time budget: it
    # is the GPU runs' wall-clock cut, which interpreted kernels on a loaded machine can pass.
    kernels = ("flash_attention", "rms_norm")
    _smoke(PEERS, "--dry-run", "--out", str(out), "--budget-s", "inf", "--kernels", *kernels)
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == set(kernels), rows
    assert rows and all(r["status"] == "ok" for r in rows), rows
    assert any("fwd_bwd_gbps" in r for r in rows) and any("fwd_bwd_tflops" in r for r in rows), rows
    for r in rows:
        assert r["timing"] == "wall clock" and r["eager_fwd_bwd_ms"] > 0 and r["eager_fwd_ms"] > 0
        if "fwd_bwd_gbps" in r:
            assert r["fwd_gbps"] > 0 and r["fraction_of_bandwidth"] > 0
