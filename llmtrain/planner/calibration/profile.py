"""Describe this machine as a cluster: measured matmul FLOP/s, memory bandwidth, gloo collective costs.

The only planner module that uses torch, imported lazily so the planner itself runs without it.
`profile_local` measures everything (2 gloo processes on loopback for the link); `local_cluster` is the
quick description `parallel.auto` uses at launch: the preset for a known GPU, otherwise measured compute
and memory with loopback link defaults.
"""

from __future__ import annotations

import functools
import os
import time
from queue import Empty
from typing import Any

from llmtrain.planner.calibration.timing import best_time
from llmtrain.planner.cluster.files import cluster_from_dict, load_cluster
from llmtrain.planner.cluster.hardware import Cluster

# Loopback TCP (gloo) figures used when the link is not measured.
LOOPBACK_LINK = {"bandwidth_gbs": 2.0, "latency_us": 60.0, "efficiency": 1.0}


def measure_matmul_tflops(precision: str = "fp32", device: str = "cpu", seconds: float = 0.2) -> float:
    """Best achieved TFLOP/s of square matmuls (several sizes) at `precision`."""
    import torch

    from llmtrain.precision import torch_dtype

    dtype = torch_dtype(precision)
    sizes = (1024, 2048, 4096) if device != "cpu" else (256, 512, 1024)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)

        def run(a=a, b=b) -> None:
            torch.mm(a, b)
            if device != "cpu":
                torch.cuda.synchronize()

        best = max(best, 2 * n**3 / best_time(run, seconds / len(sizes)) / 1e12)
    return best


def measure_memory_bandwidth_gbs(device: str = "cpu", mbytes: int = 256, seconds: float = 0.2) -> float:
    """Copy bandwidth (read + write bytes per second) of a large buffer, GB/s."""
    import torch

    src = torch.empty(mbytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()

    return 2 * src.numel() * 4 / best_time(run, seconds) / 1e9


def _gloo_worker(rank: int, world: int, port: int, mbytes: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        small = torch.zeros(2)
        large = torch.zeros(mbytes * 2**20 // 4)
        reps = 20
        dist.barrier()
        # A fixed count, not a time limit: every rank must run the same number of collectives.
        ar_small = min(_timed(lambda: dist.all_reduce(small)) for _ in range(50))
        ar_large = min(_timed(lambda: dist.all_reduce(large)) for _ in range(3))

        def ping(t: torch.Tensor) -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        dist.barrier()
        p2p_small = min(_timed(lambda: [ping(small) for _ in range(reps)]) for _ in range(3)) / reps / 2
        dist.barrier()
        p2p_large = min(_timed(lambda: ping(large)) for _ in range(3)) / 2
        if rank == 0:
            out.put(
                {
                    "ar_small": ar_small,
                    "ar_large": ar_large,
                    "p2p_small": p2p_small,
                    "p2p_large": p2p_large,
                    "bytes": large.numel() * 4,
                }
            )
    finally:
        dist.destroy_process_group()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _result_of(procs: list[Any], queue: Any) -> dict[str, Any]:
    """Rank 0's measurement, or a RuntimeError as soon as a worker dies without one (no blind wait)."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode == 0 for p in procs):
                codes = ", ".join(f"{p.name} exit {p.exitcode}" for p in procs)
                raise RuntimeError(f"the link measurement ended without a result ({codes})") from None


def run_local_workers(target: Any, world: int, *args: Any) -> dict[str, Any]:
    """Run target(rank, world, store_port, *args, queue) in `world` spawned local processes and return what
    rank 0 puts on the queue; a worker that dies gets its peers killed and the error raised."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # The store binds its port itself (port 0): a port picked free and bound later can be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=target, args=(r, world, store.port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _result_of(procs, queue)
    except BaseException:
        for p in procs:
            p.kill()  # a surviving peer waits for the dead one forever and would block interpreter exit
        raise
    finally:
        for p in procs:
            p.join(timeout=60)


def measure_gloo(mbytes: int = 16) -> dict[str, float]:
    """All-reduce and point-to-point latency (us) and bandwidth (GB/s) between 2 local gloo processes."""
    raw = run_local_workers(_gloo_worker, 2, mbytes)
    size = raw["bytes"]
    # 2-rank ring all-reduce: 2 latencies plus each rank sending half the buffer twice (= the whole buffer).
    ar_latency = raw["ar_small"] / 2
    ar_bw = size / max(raw["ar_large"] - raw["ar_small"], 1e-9)
    p2p_bw = size / max(raw["p2p_large"] - raw["p2p_small"], 1e-9)
    return {
        "allreduce_latency_us": ar_latency * 1e6,
        "allreduce_bandwidth_gbs": ar_bw / 1e9,
        "p2p_latency_us": raw["p2p_small"] * 1e6,
        "p2p_bandwidth_gbs": p2p_bw / 1e9,
    }


def ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def describe_local(devices: int = 2, measure_links: bool = True, seconds: float = 0.2) -> dict[str, Any]:
    """This machine as a cluster dict (one node of `devices` processes sharing the CPU, or its GPUs)."""
    import torch

    if torch.cuda.is_available():
        dev = "cuda"
        name = torch.cuda.get_device_name(0)
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
        devices = min(devices, torch.cuda.device_count()) or 1
    else:
        dev, name = "cpu", f"cpu-{os.cpu_count()}-cores"
        memory_gb = ram_gb() / devices  # processes share the machine's memory
    peaks = {p: measure_matmul_tflops(p, dev, seconds) for p in ("fp32", "bf16")}
    if dev == "cpu":
        peaks = {k: v / devices for k, v in peaks.items()}  # processes share the cores
    bandwidth = measure_memory_bandwidth_gbs(dev, seconds=seconds) / (devices if dev == "cpu" else 1)
    link = dict(LOOPBACK_LINK)
    measured = {}
    if measure_links:
        measured = measure_gloo()
        link = {
            "bandwidth_gbs": round(measured["p2p_bandwidth_gbs"], 3),
            "latency_us": round(measured["p2p_latency_us"], 1),
            "efficiency": 1.0,
        }
    desc = (
        f"Measured on this machine by tools/plan.py --profile-local: matmul best of square sizes, "
        "copy bandwidth, "
        f"gloo loopback {measured}"
    )
    return {
        "name": f"local-{name}",
        "description": desc,
        "devices": {
            name: {
                # The measured best is the achievable peak: efficiency 1 at the top of the curve.
                "peak_tflops": {k: round(v, 4) for k, v in peaks.items()},
                "memory_gb": round(memory_gb, 2),
                "memory_bandwidth_gbs": round(bandwidth, 2),
                "gemm_efficiency": 1.0,
                "memory_efficiency": 1.0,
                "attention_efficiency": 0.5,
                "kernel_overhead_us": 10.0 if dev == "cpu" else 4.0,
                "reserved_gb": 0.5,
            }
        },
        "nodes": [{"count": 1, "devices_per_node": devices, "device": name, "intra_link": "intra_node"}],
        "links": {"intra_node": link, "inter_node": dict(link)},
    }


def preset_for(device_name: str, memory_gib: float) -> str | None:
    """The shipped preset of a GPU by its name and memory (torch's total_memory in GiB), or None for a
    device no preset describes (then calibrate it: tools/calibrate.py). An A100 is the 40 GB or the 80 GB
    part by its memory; the presets describe the SXM boards."""
    name = device_name.lower()
    if "h200" in name:
        return "h200-141gb"
    if "h100" in name:
        return "h100-80gb"
    if "a100" in name:
        return "a100-40gb" if memory_gib < 60 else "a100-80gb"
    return None


@functools.lru_cache(maxsize=8)
def local_cluster(world_size: int) -> Cluster:
    """The cluster `parallel.auto` plans on when no file is given: a known GPU's preset (any count of its
    nodes), otherwise this machine's quickly measured compute and memory with loopback link defaults for
    the processes of one node (torchrun's LOCAL_WORLD_SIZE; the nodes are alike). For an accurate profile
    of an unknown device run tools/calibrate.py and pass its file as parallel.cluster."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        preset = preset_for(props.name, props.total_memory / 2**30)
        if preset:
            return load_cluster(preset)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    desc = describe_local(min(per_node, world_size), measure_links=False, seconds=0.1)
    return cluster_from_dict(desc, "local (uncalibrated: run tools/calibrate.py)")
