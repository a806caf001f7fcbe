"""The peak dense FLOP/s of one device at the training precision: the denominator of MFU, with its source.

MFU is only shown against a peak we can stand behind:
- `logging.peak_tflops` when set (the user's figure, labelled as such);
- a known GPU's dense (not 2:4-sparse) datasheet figure, found by device name;
- on another CUDA device, the best rate of large matmuls at the training dtype measured at start-up,
  labelled "measured": an achievable peak, so MFU against it reads higher than against a datasheet.
A CPU has none: its peak depends on core count, vector units, clocks and neighbours, and a short benchmark
on a shared machine can be far off either way (a bf16 matmul on a CPU without bf16 units is emulated and
slow, which once made a 150 tokens/s run read 75% MFU). There MFU is not shown unless peak_tflops is set.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from llmtrain.precision import torch_dtype

# Dense TFLOP/s from NVIDIA's datasheets (the sparse figures are exactly twice these).
# Keys are matched as substrings of torch.cuda.get_device_name(), most specific first.
_GPU_PEAKS_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5 ("H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
]

# Square matmul sizes for the measured peak: large enough that a GPU's tensor cores reach their best rate.
_MEASURE_SIZES = (4096, 8192)
_MEASURE_SECONDS = 0.2


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak dense FLOP/s of one device and where the figure comes from."""

    flops: float
    source: str
    """'logging.peak_tflops', 'datasheet <device name>' or 'measured <device name>'."""

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


def gpu_peak_tflops(device_name: str, precision: str, allow_tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of a known GPU for `precision` (fp32 counts as tf32 when TF32 matmuls are on)."""
    key = "tf32" if precision == "fp32" and allow_tf32 else precision
    # fp8 runs are measured against the bf16 peak, as torchtitan reports them: only the blocks' GEMMs are
    # float8, so an fp8 MFU above the bf16 run's is the speedup itself.
    key = "bf16" if precision == "fp8" else key
    lowered = device_name.lower()
    for pattern, peaks in _GPU_PEAKS_TFLOPS:
        if pattern.lower() in lowered:
            return peaks[key]
    return None


def measured_matmul_tflops(precision: str, device: torch.device | str) -> float:
    """Best rate in TFLOP/s of large square matmuls at `precision` on a CUDA `device` (each timed alone)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a measured peak needs a CUDA device; got {device}")
    dtype = torch_dtype(precision)
    # A private generator: measuring must not shift the training RNG stream (dropout, init) of the run.
    generator = torch.Generator(device=device).manual_seed(0)
    best = 0.0
    for n in _MEASURE_SIZES:
        a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        b = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        torch.mm(a, b)  # warm-up: the first call pays for allocation and kernel selection
        deadline = time.perf_counter() + _MEASURE_SECONDS
        while time.perf_counter() < deadline:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            torch.cuda.synchronize(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e12)
        del a, b
    return best


def device_peak(
    precision: str, device: torch.device | str, configured_tflops: float | None = None
) -> Peak | None:
    """Peak dense FLOP/s of one device: configured, else a known GPU's datasheet, else measured on CUDA;
    None on a CPU without a configured figure (no MFU then)."""
    torch_dtype(precision)  # names a bad precision
    if configured_tflops is not None:
        if configured_tflops <= 0:
            raise ValueError(f"logging.peak_tflops must be positive; got {configured_tflops}")
        return Peak(configured_tflops * 1e12, "logging.peak_tflops")
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = gpu_peak_tflops(name, precision, torch.backends.cuda.matmul.allow_tf32)
    if known is not None:
        return Peak(known * 1e12, f"datasheet {name}")
    return Peak(measured_matmul_tflops(precision, device) * 1e12, f"measured {name}")
