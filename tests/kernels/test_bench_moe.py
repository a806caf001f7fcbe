"""benchmarks/bench_moe.py: the smoke run goes end to end, and its agreement check catches a mismatch.

The smoke run goes through the script's main() in this process (the module is loaded once for the file): a
subprocess would import torch and transformers again for nothing the test checks. The expert-parallel run
stays a subprocess: its ranks unpickle the benchmark's rank function by module name, which the fork server's
path (fixed when the server starts, maybe by another test module) need not reach."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"


@functools.cache
def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_moe", bench)  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    return sys.modules["bench_moe"]


@pytest.mark.slow
def test_smoke_run_times_every_row(capsys):
    assert _bench_module().main(["--smoke"]) == 0
    stdout = capsys.readouterr().out
    for dtype in ("fp32", "bf16"):
        assert f"== smoke {dtype}" in stdout
    for row in ("llmtrain (auto)", "transformers grouped_mm", "transformers eager", "local dispatch"):
        timed = re.findall(rf"^  {re.escape(row)}.* \d+\.\d ms", stdout, flags=re.MULTILINE)
        assert len(timed) == 2, stdout  # one per dtype


def test_check_match_catches_different_weights():
    bench = _bench_module()
    hf, ours = bench.build_blocks(bench.SMOKE, torch.float32)
    x = torch.randn(1, bench.SMOKE.tokens, bench.SMOKE.hidden, requires_grad=True)
    dy = torch.randn_like(x)
    assert bench.check_match(hf, ours, x, dy) < bench.TOLERANCE[torch.float32]
    with torch.no_grad():
        ours.experts.down_proj[1] *= 1.01
    with pytest.raises(AssertionError, match="differ"):
        bench.check_match(hf, ours, x, dy)


@pytest.mark.slow
def test_smoke_run_times_expert_parallel_dispatch():
    # Its own test: spawning the gloo processes takes longer than the rest of the smoke run.
    cmd = [sys.executable, str(BENCH), "--smoke", "--dtype", "fp32", "--ep", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = re.search(
        r"^  ep=2 \(2 processes.*: ep=1 (\d+\.\d) ms, ep=2 (\d+\.\d) ms \(\d+\.\d\dx ep=1\), "
        r"of which all-to-all (\d+\.\d) ms",
        out.stdout,
        flags=re.MULTILINE,
    )
    assert row, out.stdout
    whole, ep, exchange = map(float, row.groups())
    assert 0 < exchange <= ep and whole > 0  # the all-to-alls ran, inside the timed EP step
