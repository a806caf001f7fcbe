"""Calibration of one device (tools/calibrate.py): matmul throughput over shapes and dtypes (and a table of a
linear layer's three matmuls from small to large shapes on one process's share of the cores), fused
attention, the memory-bound operators of a reference block and the cross-entropy, memory copy bandwidth,
fresh host pages, kernel launch overhead, the host time per dispatched operator, host copies and a host Adam
step. Torch is imported lazily (the planner itself runs without it).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from typing import Any

from llmtrain.planner.calibration.profile import measure_memory_bandwidth_gbs
from llmtrain.planner.calibration.timing import best_time, least_disturbed, repeat, run_times
from llmtrain.planner.cluster.hardware import FRESH_PAGE_BYTES
from llmtrain.planner.cost.host_ops import CE_PASSES

GEMM_SHAPES_GPU = ((4096, 4096, 4096), (8192, 8192, 2048), (2048, 8192, 8192), (16384, 4096, 1024))
GEMM_SHAPES_CPU = ((512, 512, 512), (1024, 1024, 1024), (2048, 512, 2048))
"""(m, n, k) of the timed matmuls: square, and the wide/deep shapes transformer projections have."""
TABLE_WIDTHS_GPU = (256, 512, 1024, 2048, 4096)
TABLE_WIDTHS_CPU = (32, 64, 128, 256)
"""Widths d of the matmul table: per d, 8d tokens through a d -> d, a d -> 4d and a 4d -> d projection (a
layer's attention and MLP shapes), so the table spans the small kernels of small layers up to large ones."""


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

            out[dtype][f"{m}x{n}x{k}"] = 2 * m * n * k / best_time(run, seconds / len(shapes)) / 1e12
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
                    statistics.median(run_times(run, share, TABLE_ROUND_RUNS)) for _ in range(TABLE_ROUNDS)
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
        return best_time(chain, seconds) / Count.ops * 1e6
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

    rates = repeat(rate, seconds, MEMORY_RUNS)
    x = built[2]
    return float(x.numel() * x.element_size()), statistics.median(rates) / 1e9


def _softmax_rate(kind: str, elements: int, seconds: float) -> tuple[float, float]:
    """(bytes of the fp32 logits, achieved GB/s) of F.cross_entropy's forward and backward over `elements`
    logits, counting host_ops.CE_PASSES' reference passes over them; the median run, as the tables."""
    import torch
    import torch.nn.functional as F

    logits = torch.randn(elements // SOFTMAX_ROW, SOFTMAX_ROW, device=kind, requires_grad=True)
    labels = torch.randint(0, SOFTMAX_ROW, (elements // SOFTMAX_ROW,), device=kind)

    def run() -> None:
        F.cross_entropy(logits, labels).backward()
        _sync(kind)

    nbytes = 4.0 * elements
    seconds_per_run = statistics.median(run_times(run, seconds, MEMORY_RUNS))
    return nbytes, sum(CE_PASSES["reference"]) * nbytes / seconds_per_run / 1e9


def measure_fresh_page_gbs(seconds: float) -> float:
    """GB/s of first touching fresh pages on the host: filling a newly allocated tensor of twice
    cluster.FRESH_PAGE_BYTES (mapped from the system, its pages faulted in and zeroed) minus filling one
    kept from before, over its bytes; the fastest of MEMORY_RUNS runs or more of each."""
    import torch

    n = 2 * FRESH_PAGE_BYTES // 4
    kept = torch.empty(n)
    fresh = best_time(lambda: torch.empty(n).fill_(1.0), seconds / 2, MEMORY_RUNS)
    reused = best_time(lambda: kept.fill_(1.0), seconds / 2, MEMORY_RUNS)
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
    as llmtrain.planner.cost.flops does) on `threads` CPU threads (one process's share; ignored on a GPU)."""
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
        return 3 * 4 * b * heads * s * s * d / best_time(run, seconds) / 1e12
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

    return best_time(run, seconds) / reps * 1e6


def measure_host(kind: str, seconds: float) -> tuple[float, float]:
    """(device-host copy GB/s, billions of parameters per second of a host Adam step)."""
    import torch

    params = torch.zeros(2**22)
    params.grad = torch.randn_like(params)
    adam = torch.optim.Adam([params], lr=1e-3, foreach=True)
    adam.step()
    adam_rate = params.numel() / best_time(adam.step, seconds) / 1e9
    if kind == "cpu":
        return measure_memory_bandwidth_gbs("cpu", seconds=seconds), adam_rate
    host = torch.empty(2**26, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=kind)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        _sync(kind)

    return host.numel() / best_time(copy, seconds) / 1e9, adam_rate
