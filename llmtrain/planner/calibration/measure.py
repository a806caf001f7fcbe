"""One calibration run of this machine (tools/calibrate.py): its compute with some processes (GPUs) per
node (llmtrain.planner.calibration.compute), then its links (calibration.links), as Measurements that
`calibration.measurements.profile_of` turns into a cluster file.
"""

from __future__ import annotations

import os

from llmtrain.planner.calibration.compute import (
    ATTENTION_DTYPE,
    measure_attention_tflops,
    measure_fresh_page_gbs,
    measure_gemm_table,
    measure_gemms,
    measure_host,
    measure_host_op_us,
    measure_launch_us,
    measure_memory_table,
    process_threads,
)
from llmtrain.planner.calibration.links import dist_has_nccl, measure_links
from llmtrain.planner.calibration.measurements import Measurements
from llmtrain.planner.calibration.profile import measure_memory_bandwidth_gbs, ram_gb


def measure(
    devices: int = 2,
    group_sizes: tuple[int, ...] = (2, 4),
    sizes: tuple[int, ...] = (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**23),
    reps: int = 10,
    seconds: float = 0.3,
) -> Measurements:
    """Measure this machine: its compute with `devices` processes (GPUs) per node, and its links."""
    import torch

    if torch.cuda.is_available():
        kind, name = "cuda", torch.cuda.get_device_name(0)
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
        devices = min(devices, torch.cuda.device_count())
        dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    else:
        kind, name = "cpu", f"cpu-{os.cpu_count()}-cores"
        memory_gb = ram_gb() / devices
        dtypes = ("fp32", "bf16")
    threads = process_threads(devices) if kind == "cpu" else torch.get_num_threads()

    host_gbs, adam = measure_host(kind, seconds)
    result = Measurements(
        device=name,
        device_kind=kind,
        devices=devices,
        memory_gb=memory_gb,
        gemm_tflops=measure_gemms(kind, dtypes, seconds),
        attention_tflops=measure_attention_tflops(kind, ATTENTION_DTYPE[kind], seconds, threads),
        memory_bandwidth_gbs=measure_memory_bandwidth_gbs(kind, seconds=seconds),
        launch_us=measure_launch_us(kind, seconds),
        host_bandwidth_gbs=host_gbs,
        host_adam_gparams=adam,
        # Four times the peak's budget: 12 shapes, and the largest need a few runs each to be timed at all.
        gemm_table=measure_gemm_table(kind, dtypes, 4 * seconds, threads),
        host_op_us=measure_host_op_us(kind, seconds, threads),
    )
    result.memory_table = measure_memory_table(kind, seconds, threads)
    if kind == "cpu":
        result.fresh_page_gbs = measure_fresh_page_gbs(seconds)
    backends = ["gloo"] + (["nccl"] if kind == "cuda" and dist_has_nccl() else [])
    for backend in backends:
        for group in group_sizes:
            if backend == "nccl" and group > torch.cuda.device_count():
                continue
            result.links += measure_links(backend, group, sizes, reps)
    return result
