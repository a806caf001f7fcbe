"""What one calibration run measured (Measurements: the device's figures, and a LinkFit per collective,
backend and group size) and `profile_of`, which turns it into a cluster YAML structure whose every constant
names this run as its source (the tables as Device.gemm_table, Device.memory_table and Link.measured, which
the cost model interpolates), with the raw tables kept under `calibration`. Pure Python.
"""

from __future__ import annotations

import datetime
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from llmtrain.planner.calibration.compute import ATTENTION_DTYPE, process_threads
from llmtrain.planner.calibration.links import BURST_MATMULS, LinkFit


@dataclass
class Measurements:
    """Everything one calibration run measured on this machine."""

    device: str
    device_kind: str
    """cpu or cuda."""
    devices: int
    """Processes (GPUs) per node the profile describes."""
    memory_gb: float
    gemm_tflops: dict[str, dict[str, float]]
    """dtype -> "MxNxK" -> achieved TFLOP/s."""
    attention_tflops: float
    memory_bandwidth_gbs: float
    launch_us: float
    host_bandwidth_gbs: float
    host_adam_gparams: float
    gemm_table: dict[str, list[list[float]]] = field(default_factory=dict)
    """dtype -> [FLOPs, achieved TFLOP/s] of the table's matmuls, timed with one process's share of the
    cores (CPU) or one GPU."""
    host_op_us: float = 0.0
    """Host time per dispatched operator (forward and backward) of a tiny autograd chain."""
    memory_table: dict[str, list[list[float]]] = field(default_factory=dict)
    """Operator kind -> [bytes of one tensor, achieved GB/s] of memory-bound operators, timed with one
    process's share of the cores (CPU) or one GPU (measure_memory_table)."""
    fresh_page_gbs: float = 0.0
    """GB/s of first touching freshly mapped host pages (measure_fresh_page_gbs; CPU only)."""
    links: list[LinkFit] = field(default_factory=list)

    def peak(self, dtype: str) -> float:
        """The best achieved matmul TFLOP/s of a dtype."""
        return max(self.gemm_tflops[dtype].values())


def link_of(m: Measurements) -> tuple[dict[str, float], str]:
    """The intra-node Link (per-device bandwidth, alpha) the cost model's all-reduce formula needs to
    reproduce the measured all-reduce of the profile's group size (ring: 2(p-1)/p bytes/bw + 2(p-1)
    alpha), on the fastest backend measured; and its provenance."""
    fits = [f for f in m.links if f.op == "all_reduce"]
    if not fits:
        raise ValueError("no all-reduce was measured; measure at least one group size")
    size = min((f.group for f in fits), key=lambda g: abs(g - m.devices))
    best = max((f for f in fits if f.group == size), key=lambda f: f.bytes_per_s)
    p = best.group
    bandwidth = 2 * (p - 1) / p * best.bytes_per_s
    latency = best.alpha_s / (2 * (p - 1))
    link = {
        "bandwidth_gbs": round(bandwidth / 1e9, 4),
        "latency_us": round(latency * 1e6, 2),
        "efficiency": 1.0,
    }
    return link, f"{best.backend} all-reduce over {p} local processes"


def fsdp_call_us(m: Measurements) -> float:
    """Microseconds FSDP2 adds per collective in the trainer's backend, over the group sizes measured (the
    median)."""
    backend = trainer_backend(m)
    values = [f.fsdp_call_s for f in m.links if f.backend == backend]
    return statistics.median(values) * 1e6 if values else 0.0


def after_compute_us(m: Measurements) -> float:
    """Microseconds a collective of the trainer's backend costs more after compute than back to back, over
    the group sizes measured (the median)."""
    backend = trainer_backend(m)
    values = [f.after_compute_s for f in m.links if f.backend == backend]
    return statistics.median(values) * 1e6 if values else 0.0


def trainer_backend(m: Measurements) -> str:
    """The backend the trainer runs on this device: nccl on GPUs where it was measured, else gloo."""
    backends = {f.backend for f in m.links}
    return "nccl" if m.device_kind == "cuda" and "nccl" in backends else "gloo"


def measured_collectives(m: Measurements) -> dict[str, dict[int, list[list[float]]]]:
    """The link's `measured` table (cluster.Link.measured): per operation and group size the measured
    (bytes, seconds) points of the backend the trainer runs on this device (nccl on GPUs where measured,
    else gloo)."""
    backend = trainer_backend(m)
    out: dict[str, dict[int, list[list[float]]]] = {}
    for f in m.links:
        if f.backend == backend:
            out.setdefault(f.op, {})[f.group] = [[float(n), t] for n, t in f.points]
    return out


def profile_of(m: Measurements, when: str | None = None) -> dict[str, Any]:
    """The cluster YAML structure of a calibration: one node of `m.devices` devices; every constant's
    source names this run."""
    when = when or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run = f"calibration run: tools/calibrate.py on {platform.node() or 'this machine'} ({m.device}), {when}"
    cpu = m.device_kind == "cpu"
    share = m.devices if cpu else 1  # processes on one CPU share its cores and memory bandwidth
    peaks = {dtype: round(m.peak(dtype) / share, 4) for dtype in m.gemm_tflops}
    link, how = link_of(m)
    attention_dtype = ATTENTION_DTYPE[m.device_kind]
    name = m.device
    d = f"devices.{name}"
    device = {
        "peak_tflops": peaks,
        "memory_gb": round(m.memory_gb, 2),
        "memory_bandwidth_gbs": round(m.memory_bandwidth_gbs / share, 2),
        "gemm_efficiency": 1.0,
        "memory_efficiency": 1.0,
        # Over the peak of the dtype it was timed in (a CPU's bf16 matmuls run several times its fp32 ones),
        # on one process's share of the cores as the per-process peak is.
        "attention_efficiency": round(min(m.attention_tflops / peaks[attention_dtype], 1.0), 3),
        "kernel_overhead_us": round(m.launch_us, 2),
        "reserved_gb": 0.5 if cpu else 2.0,
        "host_bandwidth_gbs": round(m.host_bandwidth_gbs / share, 2),
        "host_adam_gparams": round(m.host_adam_gparams / share, 4),
    }
    if m.gemm_table:
        device["gemm_table"] = {
            dtype: [[flops, round(tflops, 5)] for flops, tflops in points]
            for dtype, points in m.gemm_table.items()
        }
    if m.memory_table:
        device["memory_table"] = {
            name: [[nbytes, round(gbs, 4)] for nbytes, gbs in points]
            for name, points in m.memory_table.items()
        }
    if m.fresh_page_gbs:
        device["fresh_page_gbs"] = round(m.fresh_page_gbs, 3)
    fsdp = fsdp_call_us(m)
    if fsdp:
        device["fsdp_call_us"] = round(fsdp, 2)
    if m.host_op_us:
        device["host_op_us"] = round(m.host_op_us, 3)
        device["host_is_device"] = cpu
    table = measured_collectives(m)
    intra = {**link, "measured": table}
    after = after_compute_us(m)
    if after:
        intra["after_compute_us"] = round(after, 2)
    shared = f" per process ({m.devices} share this machine)" if cpu and m.devices > 1 else ""
    sources = {
        f"{d}.peak_tflops": f"{run}: best matmul TFLOP/s per dtype over the shapes of calibration.gemm_tflops"
        + shared,
        f"{d}.memory_gb": f"{run}: " + ("RAM" + shared if cpu else "the device's total memory"),
        f"{d}.memory_bandwidth_gbs": f"{run}: copy bandwidth (read + write) of a 256 MiB buffer" + shared,
        f"{d}.gemm_efficiency": f"{run}: 1 (peak_tflops is the achieved best, not a datasheet figure)",
        f"{d}.memory_efficiency": f"{run}: 1 (memory_bandwidth_gbs is the achieved copy bandwidth)",
        f"{d}.attention_efficiency": f"{run}: fused attention forward+backward TFLOP/s over peak_tflops of "
        f"its dtype ({attention_dtype})" + shared,
        f"{d}.kernel_overhead_us": f"{run}: time per tiny kernel issued back to back",
        f"{d}.reserved_gb": "assumption (not measured): runtime context and library workspaces",
        f"{d}.host_bandwidth_gbs": f"{run}: "
        + ("the device is the host: copy bandwidth" if cpu else "pinned host-to-device copy of 64 MiB"),
        f"{d}.host_adam_gparams": f"{run}: torch Adam (foreach) step over 4M fp32 parameters on the host"
        + shared,
        "links.intra_node.bandwidth_gbs": f"{run}: {how}, fitted alpha-beta (calibration.links)",
        "links.intra_node.latency_us": f"{run}: {how}, fitted alpha-beta (calibration.links)",
        "links.intra_node.efficiency": f"{run}: 1 (the bandwidth is the achieved one)",
        "links.intra_node.measured": f"{run}: {', '.join(table)} times over message sizes per group size "
        "(calibration.links' points)",
        "links.inter_node.bandwidth_gbs": "not measured (one machine): the intra-node link's",
        "links.inter_node.latency_us": "not measured (one machine): the intra-node link's",
        "links.inter_node.efficiency": "not measured (one machine): the intra-node link's",
    }
    if m.gemm_table:
        sources[f"{d}.gemm_table"] = (
            f"{run}: matmuls of calibration.TABLE_WIDTHS shapes, achieved TFLOP/s"
            + (f" on {process_threads(m.devices)} thread(s) per process" if cpu else "")
        )
    if m.memory_table:
        sources[f"{d}.memory_table"] = (
            f"{run}: a reference LLaMA block's memory-bound operators (calibration.MEMORY_TOKENS) and the "
            "reference cross-entropy (calibration.SOFTMAX_ELEMENTS), achieved GB/s of the bytes they move"
            + (f" on {process_threads(m.devices)} thread(s) per process" if cpu else "")
        )
    if m.fresh_page_gbs:
        sources[f"{d}.fresh_page_gbs"] = (
            f"{run}: filling a newly allocated 64 MiB tensor minus filling a kept one, per byte"
        )
    if fsdp:
        sources[f"{d}.fsdp_call_us"] = (
            f"{run}: a fully_shard'ed layer's step minus its bare collectives, per collective "
            "(calibration.links' fsdp_call_s)"
        )
    if after:
        sources["links.intra_node.after_compute_us"] = (
            f"{run}: a 64 KiB {trainer_backend(m)} all-reduce after {BURST_MATMULS} 256^3 matmuls per "
            "rank, minus the two apart (calibration.links' after_compute_s)"
        )
    if m.host_op_us:
        sources[f"{d}.host_op_us"] = f"{run}: tiny autograd op chain, host time per dispatched operator"
        sources[f"{d}.host_is_device"] = f"{run}: the device is {'the host CPU' if cpu else 'a GPU'}"
    raw = asdict(m)
    raw["links"] = [
        {k: (list(map(list, v)) if k == "points" else v) for k, v in asdict(f).items()} for f in m.links
    ]
    return {
        "name": f"calibrated-{name}",
        "description": f"{run}; tools/plan.py --cluster reads it",
        "devices": {name: device},
        "nodes": [{"count": 1, "devices_per_node": m.devices, "device": name, "intra_link": "intra_node"}],
        "links": {"intra_node": intra, "inter_node": dict(link)},
        "sources": sources,
        "calibration": raw,
    }
