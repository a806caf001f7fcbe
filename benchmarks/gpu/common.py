"""Shared pieces of the one-GPU benchmark suite (run_all.sh): the device, optional peers, result files.

Every step script writes one JSON file into the run's results folder; report.py gathers them. A dry run
(`--dry-run`, set by `run_all.sh --cpu-dry-run`) runs the same code on CPU at tiny shapes under
TRITON_INTERPRET=1, so the whole suite can be exercised without a GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Optional peers, by import name -> distribution name. Absent ones are reported as "not installed".
PEERS = {
    "flash_attn": "flash-attn",
    "liger_kernel": "liger-kernel",
    "torchao": "torchao",
    "torchtitan": "torchtitan",
}


def peer_version(module: str) -> str:
    """The installed version of an optional peer, or 'not installed'."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return importlib.metadata.version(PEERS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or 'unknown'})"


def nvidia_smi() -> dict[str, str]:
    """Driver version, GPU name, memory and clocks as nvidia-smi reports them ({} without nvidia-smi)."""
    fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(fields.split(","), (v.strip() for v in out.splitlines()[0].split(",")), strict=False))


def versions() -> dict[str, str]:
    """torch, CUDA, triton, transformers and every optional peer."""
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda (torch build)": str(torch.version.cuda),
        "triton": peer_version("triton"),
        "transformers": peer_version("transformers"),
    }
    info.update({m: peer_version(m) for m in PEERS})
    return info


def _finite(value: Any) -> Any:
    # JSON has no NaN: unmeasured figures (peak memory on CPU, a ratio to a failed run) become null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, default=str, allow_nan=False) + "\n")
    print(f"wrote {path}")


class Budget:
    """A step's own time budget: variants started after it is spent are recorded as skipped, not run.

    run_all.sh also kills a step at its budget plus a margin (`timeout`), so a hung kernel cannot eat the
    other steps' time; this class lets a step stop cleanly between variants before that.
    """

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gbps(device: str, nbytes: int, reps: int = 10) -> float:
    """Device copy bandwidth (read + write bytes per second, GB/s) of a large dst.copy_(src): the ceiling
    memory-bound kernels are compared against (the issue's >= 85% target).

    On CUDA the copies are timed with events around `reps` back-to-back copies (best of 3 rounds), so
    launch and synchronisation latency stay out; on CPU with the wall clock, best single copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    best = float("inf")
    if device == "cuda":
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / reps)
    else:
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


# Kernel-name patterns of the profile's categories, checked in this order (first match wins). GEMMs: cuBLAS
# / cuBLASLt / CUTLASS kernels and Triton matmuls; attention: FlashAttention, cuDNN and efficient-attention
# SDPA kernels and ours; optimizer: torch's fused/foreach AdamW and our flat-buffer updates.
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")),
    (
        "gemm",
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "matmul",
            "scaled_mm",
            "wgmma",
            "splitk",
            "gmm",
            "aten::mm",
            "addmm",
            "bmm",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach", "optimizer", "lerp")),
    ("communication", ("nccl",)),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in lowered for p in patterns):
            return category
    return "memory-bound and other"


def profile_step(step: Any, device: str, top: int = 15) -> dict[str, Any]:
    """One call of `step()` under torch.profiler: device time per kernel category (ms), the host gaps (step
    wall time the device was idle: launch overhead, Python, synchronisation) and the `top` kernels by time.
    Where the time goes, measured rather than guessed; CPU runs record the operators' self time instead."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    if device == "cuda":
        # Device events are kernels, memcpy/memset and the user annotations' ranges (record_function,
        # e.g. "Optimizer.step#AdamW.step"), which span kernels already counted: left out.
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy_us, end = 0.0, float("-inf")
        for s, e in intervals:  # the union of kernel intervals: overlapping streams count once
            if e > end:
                busy_us += e - max(s, end)
                end = e
        times = [(e.name, e.time_range.elapsed_us()) for e in kernels]
    else:
        busy_us = 0.0
        times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    by_category: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for name, us in times:
        by_category[kernel_category(name)] = by_category.get(kernel_category(name), 0.0) + us / 1e3
        by_kernel[name] = by_kernel.get(name, 0.0) + us / 1e3
    biggest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_ms": wall_ms,
        "device_busy_ms": busy_us / 1e3,
        "host_gaps_ms": max(0.0, wall_ms - busy_us / 1e3) if device == "cuda" else None,
        "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"name": n[:120], "ms": ms, "category": kernel_category(n)} for n, ms in biggest],
    }
