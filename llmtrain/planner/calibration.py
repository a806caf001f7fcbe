"""Calibrate a cluster profile by measuring this machine (tools/calibrate.py).

Measures matmul throughput over shapes and dtypes (and a table of a linear layer's three matmuls from small
to large shapes on one process's share of the cores), fused attention, memory copy bandwidth, kernel launch
overhead, the host time per dispatched operator, host copies and a host Adam step on the device; then, per
backend (gloo; nccl where there are GPUs enough) and group size, all-reduce, all-gather, reduce-scatter and
point-to-point times over message sizes between local processes, each fitted as time = alpha + bytes * beta
and kept as measured, and what FSDP2 adds per collective. `profile_of` turns the measurements into a cluster
YAML structure whose every constant names this run as its source (the tables as Device.gemm_table and
Link.measured, which the cost model interpolates), with the raw tables kept under `calibration`. Torch is
imported lazily (the planner itself runs without it).
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from llmtrain.planner.profile import _best_time, _ram_gb, _repeat, _run_times, run_local_workers

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
"""The operations timed per backend and group size (send: a ping-pong between the first two ranks)."""
GEMM_SHAPES_GPU = ((4096, 4096, 4096), (8192, 8192, 2048), (2048, 8192, 8192), (16384, 4096, 1024))
GEMM_SHAPES_CPU = ((512, 512, 512), (1024, 1024, 1024), (2048, 512, 2048))
"""(m, n, k) of the timed matmuls: square, and the wide/deep shapes transformer projections have."""
TABLE_WIDTHS_GPU = (256, 512, 1024, 2048, 4096)
TABLE_WIDTHS_CPU = (32, 64, 128, 256)
"""Widths d of the matmul table: per d, 8d tokens through a d -> d, a d -> 4d and a 4d -> d projection (a
layer's attention and MLP shapes), so the table spans the small kernels of small layers up to large ones."""


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


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (alpha seconds, bytes per second) of time = alpha + bytes / bandwidth; alpha >= 0."""
    n = len(points)
    if n < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 message sizes; got {n}")
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    beta = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    beta = max(beta, 1e-15)  # a flat line: bandwidth beyond what was measured
    return max(my - beta * mx, 0.0), 1.0 / beta


def _sync(kind: str) -> None:
    if kind == "cuda":
        import torch

        torch.cuda.synchronize()


def measure_gemms(kind: str, dtypes: tuple[str, ...], seconds: float) -> dict[str, dict[str, float]]:
    """Achieved TFLOP/s of each shape in each dtype."""
    import torch

    from llmtrain.precision import torch_dtype

    shapes = GEMM_SHAPES_GPU if kind == "cuda" else GEMM_SHAPES_CPU
    out: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        out[dtype] = {}
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=torch_dtype(dtype), device=kind)
            b = torch.randn(k, n, dtype=torch_dtype(dtype), device=kind)

            def run(a=a, b=b) -> None:
                torch.mm(a, b)
                _sync(kind)

            out[dtype][f"{m}x{n}x{k}"] = 2 * m * n * k / _best_time(run, seconds / len(shapes)) / 1e12
    return out


COLD_BYTES = 64 * 2**20
"""The matmul table cycles through operand copies of at least this many bytes, more than a CPU's last-level
cache or a GPU's L2, so each matmul finds its operands cold, as in a training step, where the layers between
two uses of a weight or activation evict it (hot operands ran up to 30% faster for small shapes here)."""


TABLE_ROUNDS = 3
"""Rounds per table shape, each the median of at least TABLE_ROUND_RUNS timed runs; the least disturbed round
counts (least_disturbed), as for the links. The fastest single run of three, as before, moved a quick
calibration's table by up to 14% between two runs on the idle machine, and the local step-time predictions
with it (validate_planner.py --local compares against the fastest median step time of its repeats)."""
TABLE_ROUND_RUNS = 5


def table_shapes(kind: str) -> list[tuple[int, int, int]]:
    """(m, n, k) of the matmul table (TABLE_WIDTHS_*)."""
    widths = TABLE_WIDTHS_GPU if kind == "cuda" else TABLE_WIDTHS_CPU
    return [shape for d in widths for shape in ((8 * d, d, d), (8 * d, 4 * d, d), (8 * d, d, 4 * d))]


def process_threads(devices: int) -> int:
    """CPU threads one of `devices` processes gets when they share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // devices)


def measure_gemm_table(
    kind: str, dtypes: tuple[str, ...], seconds: float, threads: int
) -> dict[str, list[list[float]]]:
    """[FLOPs of one matmul, achieved TFLOP/s] of a linear layer's three matmuls per table shape (m tokens,
    n outputs, k inputs), on `threads` CPU threads (one process's share of the cores; ignored on a GPU): the
    forward (x @ W^T), the input gradient (dy @ W) and the weight gradient (dy^T @ x), timed together as
    the trainer runs them (the backward's transposed operands run at their own rates), on cold operands
    (COLD_BYTES). The cost model looks the rate up at each matmul's FLOPs (cluster.Device.gemm_table)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.precision import torch_dtype

    shapes = table_shapes(kind)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, list[list[float]]] = {}
    try:
        for dtype in dtypes:
            out[dtype] = []
            for m, n, k in shapes:
                size = torch_dtype(dtype).itemsize * (m * k + n * k + m * n)
                operands = [
                    [
                        torch.randn(r, c, dtype=torch_dtype(dtype), device=kind)
                        for r, c in ((m, k), (n, k), (m, n))
                    ]
                    for _ in range(max(1, COLD_BYTES // size))
                ]
                turn = itertools.count()

                def run(operands=operands, turn=turn) -> None:
                    x, w, dy = operands[next(turn) % len(operands)]
                    F.linear(x, w)
                    torch.mm(dy, w)
                    torch.mm(dy.t(), x)
                    _sync(kind)

                flops = 2.0 * m * n * k
                share = seconds / len(shapes) / TABLE_ROUNDS
                rounds = [
                    statistics.median(_run_times(run, share, TABLE_ROUND_RUNS)) for _ in range(TABLE_ROUNDS)
                ]
                out[dtype].append([flops, 3 * flops / least_disturbed(rounds) / 1e12])
    finally:
        torch.set_num_threads(before)
    return out


def measure_host_op_us(kind: str, seconds: float, threads: int) -> float:
    """Microseconds of host time per operator of a tiny autograd chain (a linear, an RMS norm, SiLU and a
    residual add, repeated; forward and backward), whose operators a TorchDispatchMode counts: the Python,
    dispatcher and autograd cost every operator of a layer pays before its kernel does any work."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    w = torch.randn(8, 8, device=kind, requires_grad=True)
    x0 = torch.randn(4, 8, device=kind, requires_grad=True)

    def chain() -> None:
        x = x0
        for _ in range(10):
            y = F.linear(x, w)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = x + F.silu(y)
        x.sum().backward()
        _sync(kind)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        chain()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _best_time(chain, seconds) / Count.ops * 1e6
    finally:
        torch.set_num_threads(before)


MEMORY_TOKENS_CPU = (64, 256, 1024, 4096)
MEMORY_TOKENS_GPU = (4096, 16384, 65536)
"""Tokens of the reference block whose memory-bound operators the memory table times (MEMORY_BLOCK wide):
on a CPU from hidden states that fit a core's L2 cache (64 KiB of fp32) to ones beyond it; on a GPU
activations well beyond its L2."""
MEMORY_BLOCK = {"arch": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_kv_heads": 2}
"""The reference block timed: a gated (RMSNorm, rotary, SwiGLU) LLaMA block, the layer host_ops counts."""
SOFTMAX_ELEMENTS_CPU = (2**14, 2**16, 2**18, 2**20, 2**22, 2**23)
SOFTMAX_ELEMENTS_GPU = (2**20, 2**22, 2**24, 2**26, 2**28)
"""fp32 logits of the cross-entropy the memory table times: on a CPU from 64 KiB to 32 MiB, from which size
on glibc serves allocations with fresh pages that fault on first touch (its mmap threshold's maximum on
64-bit; the cost model keeps the largest size's rate beyond it); on a GPU well beyond its L2."""
MEMORY_MAX_LAYERS = 32
"""The deepest stack of reference blocks _block_rate builds to find its tensors cold."""
MEMORY_RUNS = 5
"""At least this many timed runs per size of the memory table, the fastest counting: a shared machine's
other load slows single runs by several times (one timed run at 64 KiB came out 100x slow)."""
SOFTMAX_ROW = 4096
"""Classes per row of the timed cross-entropy (a small vocabulary or a TP shard of one)."""


class _OperatorClock:
    """A TorchDispatchMode summing the time and the bytes read and written (input and output tensors) of
    the memory-bound operators dispatched under it: every one but views, matmuls and fused attention, as
    host_ops.reference_bytes counts a layer's. The time is each operator's own (dispatch inside PyTorch
    and kernel), not the Python around it, which host_op_us charges apart."""

    def __init__(self, kind: str) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        clock = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                return clock.run(func, args, kwargs or {})

        self.mode = Mode()
        self.kind = kind
        self.seconds = 0.0
        self.moved = 0

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten

        name = func.__name__.split(".")[0]
        # _unsafe_view aliases its input although its schema does not say so.
        if func.is_view or name in ("_unsafe_view", "mm", "addmm", "bmm") or "scaled_dot_product" in name:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        _sync(self.kind)
        self.seconds += time.perf_counter() - start
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.moved += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _block_rate(kind: str, tokens: int, seconds: float) -> tuple[float, float]:
    """(bytes of the hidden states, achieved GB/s) of the reference block's memory-bound operators over a
    forward and backward of `tokens` tokens through a stack of such blocks deep enough that its weights and
    saved activations exceed COLD_BYTES (at most MEMORY_MAX_LAYERS), as a training step runs them: each
    layer's backward finds its saved tensors evicted by the layers after it (one block run forward and
    backward alone finds them hot, up to 1.5x faster here); the median rate of the runs `seconds` allow, as
    for the matmul table (the fastest run's rate moved between 9.5 and 18 GB/s from one calibration to the
    next). Each run's rate is its own bytes over its own time: the first backward creates the .grad
    tensors, later ones accumulate into them, so the bytes moved differ between runs."""
    import math

    import torch

    from llmtrain.config.schema import ModelConfig
    from llmtrain.models.causal_lm import build

    seq = min(tokens, 128)
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32

    def stack(layers: int) -> tuple[Any, Any, Any, Any]:
        cfg = ModelConfig(**MEMORY_BLOCK, num_layers=layers, vocab_size=256, seq_length=seq, kernels="torch")
        model = build(cfg).to(device=kind, dtype=dtype).train()
        x = torch.randn(tokens // seq, seq, cfg.hidden_size, device=kind, dtype=dtype, requires_grad=True)
        return model, model.rope(seq, torch.device(kind), dtype), x, torch.ones_like(x)

    def step(model: Any, rope: Any, x: Any, grad: Any) -> _OperatorClock:
        clock = _OperatorClock(kind)
        with clock.mode:
            y = x
            for layer in model.layers:
                y = layer(y, rope)
            y.backward(grad)
        return clock

    one = stack(1)
    step(*one)  # warm-up: allocation, rotary tables
    per_layer = step(*one).moved + sum(p.numel() * p.element_size() for p in one[0].layers.parameters())
    built = stack(min(max(math.ceil(COLD_BYTES / per_layer), 1), MEMORY_MAX_LAYERS))

    def rate() -> float:
        clock = step(*built)
        return clock.moved / clock.seconds

    rates = _repeat(rate, seconds, MEMORY_RUNS)
    x = built[2]
    return float(x.numel() * x.element_size()), statistics.median(rates) / 1e9


def _softmax_rate(kind: str, elements: int, seconds: float) -> tuple[float, float]:
    """(bytes of the fp32 logits, achieved GB/s) of F.cross_entropy's forward and backward over `elements`
    logits, counting host_ops.CE_PASSES' reference passes over them; the median run, as the tables."""
    import torch
    import torch.nn.functional as F

    from llmtrain.planner.host_ops import CE_PASSES

    logits = torch.randn(elements // SOFTMAX_ROW, SOFTMAX_ROW, device=kind, requires_grad=True)
    labels = torch.randint(0, SOFTMAX_ROW, (elements // SOFTMAX_ROW,), device=kind)

    def run() -> None:
        F.cross_entropy(logits, labels).backward()
        _sync(kind)

    nbytes = 4.0 * elements
    seconds_per_run = statistics.median(_run_times(run, seconds, MEMORY_RUNS))
    return nbytes, sum(CE_PASSES["reference"]) * nbytes / seconds_per_run / 1e9


def measure_fresh_page_gbs(seconds: float) -> float:
    """GB/s of first touching fresh pages on the host: filling a newly allocated tensor of twice
    cluster.FRESH_PAGE_BYTES (mapped from the system, its pages faulted in and zeroed) minus filling one
    kept from before, over its bytes; the fastest of MEMORY_RUNS runs or more of each."""
    import torch

    from llmtrain.planner.cluster import FRESH_PAGE_BYTES

    n = 2 * FRESH_PAGE_BYTES // 4
    kept = torch.empty(n)
    fresh = _best_time(lambda: torch.empty(n).fill_(1.0), seconds / 2, MEMORY_RUNS)
    reused = _best_time(lambda: kept.fill_(1.0), seconds / 2, MEMORY_RUNS)
    # Noise could make the difference vanish: at most the bandwidth of the refill itself then.
    return 4 * n / max(fresh - reused, reused) / 1e9


def measure_memory_table(kind: str, seconds: float, threads: int) -> dict[str, list[list[float]]]:
    """Per operator kind (cluster.MEMORY_KINDS), [bytes of one tensor, achieved GB/s] of the memory-bound
    operators of the trainer's reference path on `threads` CPU threads, each output freshly allocated as in
    a training step: "elementwise", a reference LLaMA block's (norms, rotary, SwiGLU, residual adds, the
    layout copies; _OperatorClock times and counts them) against its hidden states' bytes (MEMORY_TOKENS_*);
    "softmax", the reference cross-entropy's against its logits' bytes (SOFTMAX_ELEMENTS_*). The cost model
    looks the rate up at a layer's hidden-state or logits size (cluster.Device.memory_table)."""
    import torch

    tokens = MEMORY_TOKENS_GPU if kind == "cuda" else MEMORY_TOKENS_CPU
    logits = SOFTMAX_ELEMENTS_GPU if kind == "cuda" else SOFTMAX_ELEMENTS_CPU
    share = seconds / (len(tokens) + len(logits))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {
            "elementwise": [list(_block_rate(kind, n, share)) for n in tokens],
            "softmax": [list(_softmax_rate(kind, n, share)) for n in logits],
        }
    finally:
        torch.set_num_threads(before)


ATTENTION_DTYPE = {"cuda": "bf16", "cpu": "fp32"}
"""The dtype fused attention is timed in per device kind (what training runs there)."""


def measure_attention_tflops(kind: str, dtype: str, seconds: float, threads: int) -> float:
    """Forward plus backward TFLOP/s of torch's fused attention (causal; FLOPs counted over the full square,
    as llmtrain.planner.flops does) on `threads` CPU threads (one process's share; ignored on a GPU)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.precision import torch_dtype

    b, heads, s, d = (4, 16, 2048, 128) if kind == "cuda" else (1, 4, 512, 64)
    q, k, v = (
        torch.randn(b, heads, s, d, dtype=torch_dtype(dtype), device=kind, requires_grad=True)
        for _ in range(3)
    )

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        _sync(kind)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return 3 * 4 * b * heads * s * s * d / _best_time(run, seconds) / 1e12
    finally:
        torch.set_num_threads(before)


def measure_launch_us(kind: str, seconds: float) -> float:
    """Microseconds per tiny kernel issued back to back (launch and tail; the Python call included)."""
    import torch

    x = torch.zeros(1, device=kind)
    reps = 200

    def run() -> None:
        for _ in range(reps):
            x.add_(1.0)
        _sync(kind)

    return _best_time(run, seconds) / reps * 1e6


def measure_host(kind: str, seconds: float) -> tuple[float, float]:
    """(device-host copy GB/s, billions of parameters per second of a host Adam step)."""
    import torch

    params = torch.zeros(2**22)
    params.grad = torch.randn_like(params)
    adam = torch.optim.Adam([params], lr=1e-3, foreach=True)
    adam.step()
    adam_rate = params.numel() / _best_time(adam.step, seconds) / 1e9
    if kind == "cpu":
        from llmtrain.planner.profile import measure_memory_bandwidth_gbs

        return measure_memory_bandwidth_gbs("cpu", seconds=seconds), adam_rate
    host = torch.empty(2**26, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=kind)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        _sync(kind)

    return host.numel() / _best_time(copy, seconds) / 1e9, adam_rate


# ---------------------------------------------------------------------------------------------- links


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


def least_disturbed(rounds: list[float]) -> float:
    """The smallest of several rounds' medians: other processes' load and scheduling only ever add time to a
    round, so the least disturbed one is the closest to the operation's own time (each round a median
    already, one fast outlier cannot set it)."""
    if not rounds:
        raise ValueError("least_disturbed needs at least one round")
    return min(rounds)


def monotone_times(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(bytes, seconds) sorted by bytes with each time capped by every larger size's: a collective of fewer
    bytes never costs more than one of more (it could be sent padded), so a smaller size measured slower is
    noise (a disturbed round, a lazy set-up) and the larger size's time bounds it."""
    out = sorted(points)
    for i in range(len(out) - 2, -1, -1):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


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


# ---------------------------------------------------------------------------------------------- profile


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
        memory_gb = _ram_gb() / devices
        dtypes = ("fp32", "bf16")
    threads = process_threads(devices) if kind == "cpu" else torch.get_num_threads()
    from llmtrain.planner.profile import measure_memory_bandwidth_gbs

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


def dist_has_nccl() -> bool:
    """Whether torch.distributed was built with NCCL."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


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
