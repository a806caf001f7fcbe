"""Calibration of the links between local processes (tools/calibrate.py): per backend (gloo; nccl where there
are GPUs enough) and group size, all-reduce, all-gather, reduce-scatter and point-to-point times over message
sizes, each fitted as time = alpha + bytes * beta and kept as measured, what FSDP2 adds per collective, and
what a collective costs more after compute than back to back. Torch is imported lazily.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from llmtrain.planner.calibration.profile import run_local_workers
from llmtrain.planner.calibration.timing import fit_alpha_beta, least_disturbed, monotone_times

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
"""The operations timed per backend and group size (send: a ping-pong between the first two ranks)."""


@dataclass(frozen=True)
class LinkFit:
    """time(bytes) = alpha_s + bytes / bytes_per_s of one operation, backend and group size."""

    backend: str
    op: str
    group: int
    alpha_s: float
    bytes_per_s: float
    points: tuple[tuple[int, float], ...]
    """(bytes per rank's full buffer, median seconds) as measured."""
    fsdp_call_s: float = 0.0
    """Seconds FSDP2 added per collective in this backend and group (_fsdp_call_s; the same on each op)."""
    after_compute_s: float = 0.0
    """Seconds a collective of this backend and group took more after a burst of compute on every rank than
    back to back (_after_compute_s; the same on each op)."""


def _median_call_s(dist: Any, call: Any, reps: int, backend: str) -> float:
    """Median seconds of `reps` calls of a collective step, after one warm-up call (connections, buffers);
    every rank runs it, a fixed count rather than a time limit so that all run the same collectives."""
    import torch

    call()
    dist.barrier()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        if backend == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times)


ROUNDS = 3
"""Rounds of every timing of the link measurements (the whole size sweep, the FSDP2 and after-compute
differences), interleaved so that a burst of other load on a shared machine lands in one round of several
sizes rather than in every repeat of one; the least disturbed round counts (least_disturbed)."""
WARMUP_CALLS = 20
"""Small all-reduces every rank runs before the first timed size: a new process group's first collectives
set up its connections and buffers and run slower (the first size of a sweep without them: 15x the next)."""


def _collective_worker(
    rank: int, world: int, port: int, backend: str, sizes: tuple[int, ...], reps: int, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    # Newer torch renamed the flat-tensor collectives (as llmtrain.parallel.comm).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        calls: dict[int, dict[str, Any]] = {}
        for nbytes in sizes:
            full = torch.zeros(max(nbytes // 4 // world, 1) * world, device=device)
            part = torch.zeros(full.numel() // world, device=device)
            calls[full.numel() * 4] = {
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "all_gather": lambda full=full, part=part: gather(full, part),
                "reduce_scatter": lambda full=full, part=part: scatter(part, full),
                "send": lambda full=full: _ping(dist, full, rank),
            }
        tiny = torch.zeros(1, device=device)
        for _ in range(WARMUP_CALLS):
            dist.all_reduce(tiny)
        rounds: dict[str, dict[int, list[float]]] = {op: {n: [] for n in calls} for op in COLLECTIVES}
        for _ in range(ROUNDS):
            for nbytes, ops in calls.items():
                for op, call in ops.items():
                    # A ping-pong moves the buffer twice: one send is half of it.
                    median = _median_call_s(dist, call, reps, backend) / (2 if op == "send" else 1)
                    rounds[op][nbytes].append(median)
        result = {
            op: monotone_times([(n, least_disturbed(times)) for n, times in per_size.items()])
            for op, per_size in rounds.items()
        }
        fsdp = _fsdp_call_s(dist, world, device, backend, reps, gather, scatter)
        after = _after_compute_s(dist, device, backend, max(2 * reps, AFTER_COMPUTE_REPS))
        if rank == 0:
            out.put((result, fsdp, after))
    finally:
        dist.destroy_process_group()


AFTER_COMPUTE_REPS = 100
"""At least this many iterations per loop of _after_compute_s. What it measures is a mean over many
collectives (a step pays every one of them, the ranks drifting apart between them): with the quick
calibration's 10 it read 61 us on this machine where loops of 200 gave 400-700 us per collective."""
BURST_MATMULS = 8
"""256^3 matmuls each rank runs before each collective in _after_compute_s: about a millisecond on one CPU
core, what a small layer computes between two tensor-parallel collectives."""


def _after_compute_s(dist: Any, device: str, backend: str, reps: int) -> float:
    """Seconds a small all-reduce costs more when every rank issues it after a burst of compute, as training
    does, than back to back as the size sweep times it: the ranks finish their bursts apart (scheduling
    noise) and the waiting thread must be woken. Rank 0's loop of burst + all-reduce, minus its loops of
    bursts alone and of all-reduces alone, per iteration, each the least disturbed of ROUNDS rounds."""
    import torch

    a = torch.randn(256, 256, device=device)
    t = torch.zeros(2**14, device=device)

    def burst() -> None:
        for _ in range(BURST_MATMULS):
            torch.mm(a, a)

    def per_iteration(step: Any) -> float:
        step()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        if backend == "nccl":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / reps
        dist.barrier()
        return elapsed

    steps = {
        "alone": burst,
        "bare": lambda: dist.all_reduce(t),
        "both": lambda: (burst(), dist.all_reduce(t)),
    }
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            rounds[name].append(per_iteration(step))
    alone, bare, both = (least_disturbed(rounds[name]) for name in steps)
    return max(both - alone - bare, 0.0)


FSDP_UNIT_BYTES = 2**18
"""fp32 parameter bytes of the unit _fsdp_call_s shards: a small layer's, where per-call costs show."""


def _fsdp_call_s(
    dist: Any, world: int, device: str, backend: str, reps: int, gather: Any, scatter: Any
) -> float:
    """Seconds FSDP2 adds per collective: a fully_shard'ed linear resharded after its forward (ZeRO-3: an
    all-gather in the forward, another in the backward, a reduce-scatter of its gradient) stepped on one
    row, minus the same three collectives issued bare, over three (each the least disturbed of ROUNDS
    interleaved rounds). Its matmuls are one row: microseconds."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    side = int((FSDP_UNIT_BYTES // 4) ** 0.5) // world * world
    layer = torch.nn.Linear(side, side, bias=False, device=device)
    fully_shard(layer, mesh=init_device_mesh(device.split(":")[0], (world,)), reshard_after_forward=True)
    x = torch.ones(1, side, device=device)
    full = torch.zeros(side * side, device=device)
    part = torch.zeros(side * side // world, device=device)

    def sharded() -> None:
        layer(x).sum().backward()

    def bare() -> None:
        gather(full, part)
        gather(full, part)
        scatter(part, full)

    rounds: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        for times, step in zip(rounds, (sharded, bare), strict=True):
            times.append(_median_call_s(dist, step, reps, backend))
    added = least_disturbed(rounds[0]) - least_disturbed(rounds[1])
    return max(added, 0.0) / 3


def _ping(dist: Any, t: Any, rank: int) -> None:
    """Rank 0 sends `t` to rank 1 and receives it back; the others wait at no cost."""
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        dist.send(t, 0)


def measure_links(backend: str, group: int, sizes: tuple[int, ...], reps: int) -> list[LinkFit]:
    """Time every collective of COLLECTIVES between `group` local processes over message `sizes` (bytes of
    the full buffer), each fitted as alpha + bytes / bandwidth."""
    raw, fsdp, after = run_local_workers(_collective_worker, group, backend, sizes, reps)
    fits = []
    for op, points in raw.items():
        alpha, bandwidth = fit_alpha_beta(points)
        fits.append(LinkFit(backend, op, group, alpha, bandwidth, tuple(points), fsdp, after))
    return fits


def dist_has_nccl() -> bool:
    """Whether torch.distributed was built with NCCL."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()
