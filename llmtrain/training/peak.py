"""Peak dense FLOP/s of one device for the dtype in use: the denominator of MFU.

GPUs: the vendor's dense (not 2:4-sparse) tensor-core figures by device name. CPUs have no datasheet
figure we can trust (core count, clocks, AVX width and neighbours all vary), so there the peak is a
short matmul benchmark at the training dtype, cached per process, or `logging.peak_tflops`.
"""

from __future__ import annotations

import functools
import time

import torch

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

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpu_peak_tflops(device_name: str, precision: str, allow_tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of a known GPU for `precision` (fp32 counts as tf32 when TF32 matmuls are on)."""
    key = "tf32" if precision == "fp32" and allow_tf32 else precision
    lowered = device_name.lower()
    for pattern, peaks in _GPU_PEAKS_TFLOPS:
        if pattern.lower() in lowered:
            return peaks[key]
    return None


def _best_matmul_tflops(dtype: torch.dtype, device: str, sizes: tuple[int, ...], seconds: float) -> float:
    """Fastest square matmul seen, in TFLOP/s, over `seconds` per size."""
    on_cuda = torch.device(device).type == "cuda"
    best = 0.0
    # A private generator: measuring must not shift the training RNG stream (dropout, init) of the run.
    generator = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        b = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        torch.mm(a, b)  # warm-up: the first call pays for allocation and kernel selection
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.mm(a, b)
            if on_cuda:
                torch.cuda.synchronize()
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


@functools.cache
def measured_matmul_tflops(precision: str, device: str = "cpu", threads: int = 1) -> float:
    """Peak TFLOP/s of `device` at `precision` from a ~0.3 s matmul benchmark (cached per process).

    On CPU it is the best single-thread rate times `threads` (torch's intra-op thread count): a
    short multi-threaded benchmark on a shared machine reads far too low whenever one thread is
    descheduled, while one thread's best of many short trials catches an uncontended moment. Perfect
    scaling over threads (and single-core turbo) make this an upper bound, so MFU stays <= 100%.
    """
    dtype = _DTYPES[precision]
    if torch.device(device).type == "cuda":
        return _best_matmul_tflops(dtype, device, (2048, 4096, 8192), 0.1)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_thread = _best_matmul_tflops(dtype, device, (128, 256, 512), 0.1)
    finally:
        torch.set_num_threads(previous)
    return per_thread * threads


def device_peak_flops(
    precision: str, device: torch.device | str, configured_tflops: float | None = None
) -> float:
    """Dense peak FLOP/s of one device: configured, else the known GPU figure, else measured."""
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {', '.join(_DTYPES)}; got {precision!r}")
    if configured_tflops is not None:
        if configured_tflops <= 0:
            raise ValueError(f"logging.peak_tflops must be positive; got {configured_tflops}")
        return configured_tflops * 1e12
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_peak_tflops(name, precision, torch.backends.cuda.matmul.allow_tf32)
        if known is not None:
            return known * 1e12
        return measured_matmul_tflops(precision, str(device)) * 1e12
    return measured_matmul_tflops(precision, device.type, torch.get_num_threads()) * 1e12
