"""Benchmark llmtrain's Triton kernels against PyTorch eager, torch.compile, Liger-Kernel, SDPA, flash-attn.

On a CUDA GPU: forward+backward time, achieved GB/s (memory-bound kernels) or TFLOP/s (attention, fused
linear CE) and peak memory at LLaMA-3-8B shapes, printed with ratios against our Triton kernel.
Without a GPU it says so and exits 0.

  python benchmarks/bench_kernels.py                 # GPU benchmark
  python benchmarks/bench_kernels.py --cpu-memory    # peak host memory: fused linear CE vs logits + CE (CPU)
  TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # tiny CPU run exercising every case
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import reference  # noqa: E402

# LLaMA-3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, ffn 14336, vocab 128256; one 8192-token sequence.
LLAMA3_8B = dict(tokens=8192, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)
SMOKE = dict(tokens=48, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=500)


@dataclasses.dataclass
class Case:
    """One kernel at one shape: inputs factory, implementations, and its work for GB/s or TFLOP/s."""

    name: str
    make_inputs: Callable[[], list[torch.Tensor]]
    impls: dict[str, Callable[..., torch.Tensor]]
    bytes_moved: float = 0.0  # forward + backward HBM traffic (read + write), for GB/s
    fwd_bytes: float = 0.0  # forward HBM traffic alone
    flops: float = 0.0  # forward + backward FLOPs, for TFLOP/s
    fwd_flops: float = 0.0  # forward FLOPs alone


def _liger() -> object | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    import liger_kernel.transformers.functional as liger_functional

    return liger_functional


def _flash_attn_2() -> Callable | None:
    """flash-attn 2's causal attention on our (batch, heads, seq, dim) layout, or None when not installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_func

    def run(q, k, v):
        # flash-attn takes (batch, seq, heads, dim) and handles grouped-query heads itself.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)

    return run


def _sdpa_flash(q, k, v):
    # SDPA restricted to its FlashAttention-2 backend (it raises instead of falling back to another one).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def build_cases(shape: dict, device: str, dtype: torch.dtype, compile_ok: bool) -> list[Case]:
    """The benchmark cases; each implementation maps the same inputs to one output tensor."""
    t, h, nh, nkv, d, ffn, vocab = (
        shape[k] for k in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")
    )
    el = torch.finfo(dtype).bits // 8
    liger = _liger()

    # Inputs come from a generator of their own: a CUDA-graph capture that fails (an implementation that
    # syncs with the host, as Liger's fused linear cross-entropy does) leaves the default CUDA generator
    # marked as capturing, and every later draw from it raises ("Offset increment outside graph capture").
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size, scale=1.0, grad=True):
        x = torch.randn(*size, device=device, dtype=dtype, generator=gen)
        return (scale * x).requires_grad_(grad)

    def with_compile(impls: dict, eager: Callable) -> dict:
        if compile_ok:
            impls["torch.compile"] = _compiled(eager)
        return impls

    cases = []
    rms_eager = lambda x, w: reference.rms_norm(x, w, 1e-6)
    impls = {"triton": lambda x, w: kernels.rms_norm(x, w, 1e-6, "triton"), "eager": rms_eager}
    if liger is not None:
        impls["liger"] = lambda x, w: liger.liger_rms_norm(x, w, 1e-6)
    cases.append(
        Case(
            "rms_norm",
            lambda: [rand(1, t, h), rand(h)],
            with_compile(impls, rms_eager),
            bytes_moved=el * t * h * 5,
            fwd_bytes=el * t * h * 2,
        )
    )  # fwd: x, y; bwd: x, dy, dx (the weight and the per-row rstd are negligible)

    ln_eager = lambda x, w, b: reference.layer_norm(x, w, b, 1e-5)
    impls = {"triton": lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5, "triton"), "eager": ln_eager}
    if liger is not None:
        impls["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
    cases.append(
        Case(
            "layer_norm",
            lambda: [rand(1, t, h), rand(h), rand(h)],
            with_compile(impls, ln_eager),
            bytes_moved=el * t * h * 5,
            fwd_bytes=el * t * h * 2,
        )
    )  # as RMSNorm: fwd x, y; bwd x, dy, dx

    def rope_tables():
        angles = torch.outer(
            torch.arange(t, device=device, dtype=torch.float32),
            1e4 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d),
        )
        emb = torch.cat((angles, angles), -1)
        return emb.cos(), emb.sin()

    cos, sin = rope_tables()
    tables = 2 * t * d * cos.element_size()
    rope_eager = lambda x: reference.apply_rotary(x, cos, sin, False)
    impls = {"triton": lambda x: kernels.apply_rotary(x, cos, sin, False, "triton"), "eager": rope_eager}
    cases.append(
        Case(
            "rotary (q)",
            lambda: [rand(1, t, nh, d)],
            with_compile(impls, rope_eager),
            bytes_moved=el * t * nh * d * 4 + 2 * tables,
            fwd_bytes=el * t * nh * d * 2 + tables,
        )
    )  # fwd: x, out; bwd: dy, dx; each pass also reads the fp32 cos and sin tables

    impls = {"triton": lambda g, u: kernels.swiglu(g, u, "triton"), "eager": reference.swiglu}
    if liger is not None:
        impls["liger"] = lambda g, u: liger.liger_swiglu(g, u)
    cases.append(
        Case(
            "swiglu",
            lambda: [rand(1, t, ffn), rand(1, t, ffn)],
            with_compile(impls, reference.swiglu),
            bytes_moved=el * t * ffn * 7,
            fwd_bytes=el * t * ffn * 3,
        )
    )  # fwd: g, u, out; bwd: g, u, dout, dg, du

    def attn_math(q, k, v):
        # Eager attention as a model would write it without fused kernels: scores, mask, softmax, matmul.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        mask = torch.ones(s.shape[-2:], device=s.device, dtype=torch.bool).triu(1)
        return torch.softmax(s.masked_fill(mask, float("-inf")).float(), -1).to(q.dtype) @ v

    # Eager attention materialises (heads, t, t) scores in bf16 and fp32 (~40 GiB at 8k): on a smaller GPU
    # it fails with out-of-memory, which the table reports without hiding the other rows.
    attn_t = t
    impls = {
        "triton": lambda q, k, v: kernels.flash_attention(q, k, v, True, impl="triton"),
        "sdpa": lambda q, k, v: reference.flash_attention(q, k, v, True),
        "eager": attn_math,
    }
    if device == "cuda":
        impls["sdpa (flash)"] = _sdpa_flash
    fa2 = _flash_attn_2()
    if fa2 is not None and device == "cuda":
        impls["flash-attn 2"] = fa2
    # Causal attention: 2 matmuls forward, 5 backward (recompute S, dV, dP, dQ, dK), half the square each.
    cases.append(
        Case(
            "flash_attention",
            lambda: [rand(1, nh, attn_t, d), rand(1, nkv, attn_t, d), rand(1, nkv, attn_t, d)],
            with_compile(impls, attn_math),
            flops=7 * 2 * nh * attn_t * attn_t * d / 2,
            fwd_flops=2 * 2 * nh * attn_t * attn_t * d / 2,
        )
    )

    ce_eager = lambda x, y: reference.cross_entropy(x, y)
    target = torch.randint(0, vocab, (t,), device=device, generator=gen)
    impls = {
        "triton": lambda x: kernels.cross_entropy(x, target, impl="triton"),
        "eager": lambda x: ce_eager(x, target),
    }
    if liger is not None:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger_ce = LigerCrossEntropyLoss()
        impls["liger"] = lambda x: liger_ce(x, target)
    if compile_ok:
        compiled_ce = _compiled(ce_eager)
        impls["torch.compile"] = lambda x: compiled_ce(x, target)
    # fwd: read the logits; bwd: read them again and write their gradient.
    cases.append(
        Case(
            "cross_entropy",
            lambda: [rand(t, vocab)],
            impls,
            bytes_moved=el * t * vocab * 3,
            fwd_bytes=el * t * vocab,
        )
    )

    flce_eager = lambda x, w: reference.fused_linear_cross_entropy(x, w, target)
    impls = {
        "triton": lambda x, w: kernels.fused_linear_cross_entropy(x, w, target, impl="triton"),
        "eager": flce_eager,
    }
    if liger is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_flce = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w: liger_flce(w, x, target)
    if compile_ok:
        impls["torch.compile"] = _compiled(flce_eager)
    cases.append(
        Case(
            "fused_linear_ce",
            lambda: [rand(t, h), rand(vocab, h, scale=0.02)],
            impls,
            # The problem's 3 GEMMs (logits, grad_hidden, grad_weight) for every impl, so rates compare as
            # times do; ours runs a 4th (pass 2 recomputes the logits, see kernels/chunked_ce.py).
            flops=3 * 2 * t * h * vocab,
            fwd_flops=3 * 2 * t * h * vocab,  # ours and Liger's compute the gradients in the forward
        )
    )
    return cases


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class Timing:
    """One implementation's measurement: seconds per call and how they were taken."""

    fwd: float  # forward seconds (GPU time when `method` is "cuda graph")
    fwd_bwd: float  # forward+backward seconds
    peak: float  # extra bytes over the inputs during one forward+backward (CUDA only, else nan)
    method: str  # "cuda graph", "eager launches" (CUDA events around back-to-back reps) or "wall clock"
    eager_fwd: float  # forward seconds with eager launches, launch overhead included
    eager_fwd_bwd: float  # forward+backward seconds with eager launches
    note: str = ""  # why a CUDA graph was not used, when it was not


def _rounds(reps: int) -> tuple[int, int]:
    """(rounds, calls per round): about `reps` calls in all, a median over up to 3 rounds."""
    rounds = max(1, min(3, reps))
    return rounds, max(1, reps // rounds)


def _events_per_call(run: Callable, reps: int) -> float:
    """Median seconds per call of run() over a few rounds, each timed with CUDA events around several
    back-to-back calls and one synchronisation, so the GPU queue stays full between calls."""
    rounds, per_round = _rounds(reps)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_round)
    return statistics.median(times)


def _wall_per_call(run: Callable, reps: int) -> float:
    """Median wall-clock seconds of run() over reps calls (CPU)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph_per_call(run: Callable, reps: int) -> float:
    """Median GPU seconds of run() captured once in a CUDA graph and replayed back to back: no Python or
    launch overhead, only the kernels. Raises when run() cannot be captured (host syncs, CPU work...)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as PyTorch's docs require
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        return _events_per_call(graph.replay, reps)
    finally:
        del graph


def measure(fn: Callable, inputs: list[torch.Tensor], device: str, reps: int) -> Timing:
    """Forward and forward+backward seconds per call, and peak extra memory (bytes, CUDA only).

    The backward's incoming gradient is built once, outside the timed calls, and gradients are returned
    (torch.autograd.grad) rather than accumulated into .grad, so a timed step is the kernels' own work.
    On CUDA, forward and forward+backward are each captured in a CUDA graph and replayed (GPU time); an
    implementation that cannot be captured falls back to CUDA events around back-to-back eager calls. The
    eager-launch times (what a training step without graphs pays, launch overhead included) are kept too.
    """
    leaves = [x for x in inputs if x.requires_grad]

    def forward():
        return fn(*inputs)

    out = forward()  # first call: compilation, autotuning
    dy = torch.ones_like(out)
    del out

    def step():
        torch.autograd.grad(forward(), leaves, dy)

    for _ in range(2):  # warm up: compilation and autotuning of the backward, the allocator
        step()
    _sync(device)
    if device != "cuda":
        fwd, fwd_bwd = _wall_per_call(forward, reps), _wall_per_call(step, reps)
        return Timing(fwd, fwd_bwd, float("nan"), "wall clock", fwd, fwd_bwd)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    eager_fwd, eager_fwd_bwd = _events_per_call(forward, reps), _events_per_call(step, reps)
    try:
        fwd_bwd = _graph_per_call(step, reps)
        fwd = _graph_per_call(forward, reps)
    except Exception as exc:  # not capturable: keep the eager-launch times and say why
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        note = f"cuda graph failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return Timing(eager_fwd, eager_fwd_bwd, peak, "eager launches", eager_fwd, eager_fwd_bwd, note[:200])
    finally:
        torch.cuda.empty_cache()
    return Timing(fwd, fwd_bwd, peak, "cuda graph", eager_fwd, eager_fwd_bwd)


# HBM bandwidth (GB/s) of the GPUs we expect, to print memory-bound kernels as a fraction of peak.
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}


def run_benchmarks(
    shape: dict,
    device: str,
    dtype: torch.dtype,
    reps: int,
    compile_ok: bool,
    bandwidth_gbps: float | None = None,
    seconds: float | None = None,
    first: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> list[dict]:
    """Print one table per kernel: times, throughput, peak memory, and time/memory ratios vs Triton; return
    the rows. GB/s are shown as a fraction of `bandwidth_gbps` (default: the GPU's datasheet HBM figure).
    Cases that would start after `seconds` are listed as skipped; the kernels named in `first` run first,
    in that order, so a short budget still measures them; `only`, if given, names the kernels to run."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    hbm = bandwidth_gbps or next((bw for key, bw in HBM_GBPS.items() if key in name), None)
    print(f"device: {name}, dtype: {dtype}, shapes: {shape}")
    deadline = time.monotonic() + seconds if seconds is not None else None
    rows: list[dict] = []
    cases = [c for c in build_cases(shape, device, dtype, compile_ok) if not only or c.name in only]
    rank = {name: i for i, name in enumerate(first)}
    for case in sorted(cases, key=lambda c: rank.get(c.name, len(first))):
        print(f"\n== {case.name} ==")
        if deadline is not None and time.monotonic() > deadline:
            print("skipped: the step's time budget is spent")
            rows.append({"kernel": case.name, "impl": "*", "status": "skipped (time budget)"})
            continue
        header = ("impl", "fwd ms", "fwd+bwd ms", "fwd+bwd rate", "fwd rate", "peak MiB", "t/triton")
        header += ("mem/triton", "eager f+b ms", "timing")
        print(f"{header[0]:<15}" + "".join(f"{c:>14}" for c in header[1:]))
        results: dict[str, Timing] = {}
        # Liger last: its fused linear cross-entropy cannot be captured in a CUDA graph, and a failed
        # capture may leave state behind (see build_cases) that no later implementation should meet.
        for impl, fn in sorted(case.impls.items(), key=lambda item: item[0] == "liger"):
            try:
                results[impl] = measure(fn, case.make_inputs(), device, reps)
            except Exception as exc:  # one failing baseline (e.g. out of memory) must not hide the others
                print(f"{impl:<15} failed: {type(exc).__name__}: {str(exc)[:80]}")
                rows.append(
                    {
                        "kernel": case.name,
                        "impl": impl,
                        "status": f"failed: {type(exc).__name__}: {exc}"[:300],
                    }
                )
            if device == "cuda":
                torch.cuda.empty_cache()
        ref = results.get("triton")
        ref_t, ref_m = (ref.fwd_bwd, ref.peak) if ref else (float("nan"), float("nan"))
        for impl, r in results.items():
            fwd, sec, peak = r.fwd, r.fwd_bwd, r.peak
            row = {"kernel": case.name, "impl": impl, "status": "ok", "fwd_ms": fwd * 1e3}
            row |= {"fwd_bwd_ms": sec * 1e3, "peak_mib": peak / 2**20, "time_vs_triton": sec / ref_t}
            row["mem_vs_triton"] = peak / ref_m if ref_m else float("nan")
            row |= {"timing": r.method, "eager_fwd_ms": r.eager_fwd * 1e3}
            row |= {"eager_fwd_bwd_ms": r.eager_fwd_bwd * 1e3}
            if r.note:
                row["timing_note"] = r.note
            if case.flops:
                rate = f"{case.flops / sec / 1e12:.1f} TFLOP/s"
                fwd_rate = f"{case.fwd_flops / fwd / 1e12:.1f} TFLOP/s"
                row |= {"fwd_bwd_tflops": case.flops / sec / 1e12, "fwd_tflops": case.fwd_flops / fwd / 1e12}
            else:
                gbps = case.bytes_moved / sec / 1e9
                fwd_gbps = case.fwd_bytes / fwd / 1e9
                rate = f"{gbps:.0f} GB/s" + (f" {gbps / hbm:.0%}" if hbm else "")
                fwd_rate = f"{fwd_gbps:.0f} GB/s" + (f" {fwd_gbps / hbm:.0%}" if hbm else "")
                row |= {"fwd_bwd_gbps": gbps, "fraction_of_bandwidth": gbps / hbm if hbm else None}
                row |= {"fwd_gbps": fwd_gbps, "fwd_fraction_of_bandwidth": fwd_gbps / hbm if hbm else None}
                row["eager_fraction_of_bandwidth"] = (
                    case.bytes_moved / r.eager_fwd_bwd / 1e9 / hbm if hbm else None
                )
            rows.append(row)
            cells = (
                f"{fwd * 1e3:.3f}",
                f"{sec * 1e3:.3f}",
                rate,
                fwd_rate,
                f"{peak / 2**20:.1f}",
                f"{sec / ref_t:.2f}",
                f"{peak / ref_m:.2f}" if ref_m else "nan",
                f"{r.eager_fwd_bwd * 1e3:.3f}",
                r.method,
            )
            print(f"{impl:<15}" + "".join(f"{c:>14}" for c in cells) + (f"  ({r.note})" if r.note else ""))
    return rows


def _rss_peak_child(mode: str, tokens: int, hidden: int, vocab: int, dtype: str) -> None:
    """Child process: peak resident memory above the inputs while one loss forward+backward runs."""
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    h = torch.randn(tokens, hidden, dtype=dt).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, dtype=dt)).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    # Warm up on a tiny problem so one-off allocations (thread pools, kernels) are not counted.
    small = kernels.fused_linear_cross_entropy(h[:4], w[:64], target[:4] % 64, impl="torch")
    small.backward()
    h.grad = w.grad = None
    base = _rss_now()
    _reset_peak()
    if mode == "fused":
        loss = kernels.fused_linear_cross_entropy(h, w, target, impl="torch")
    else:
        loss = reference.fused_linear_cross_entropy(h, w, target)
    loss.backward()
    print(json.dumps({"mode": mode, "peak_bytes": _peak() - base}))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_memory_comparison(tokens: int, hidden: int, vocab: int, dtype: str = "float32") -> dict[str, float]:
    """Peak host memory of logits + cross-entropy vs the chunked fused linear CE, each in a fresh process."""
    peaks = {}
    # A fixed mmap threshold: glibc's default one rises after a large free, after which freed chunks may
    # stay in the heap, so the peak resident size varied from run to run (41 MB, sometimes 49 or 55 MB for
    # the fused path); with every allocation above 1 MiB mmapped and unmapped on free it follows the live
    # tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    for mode in ("logits+ce", "fused"):
        out = subprocess.run(
            [sys.executable, __file__, "--_rss-child", mode, str(tokens), str(hidden), str(vocab), dtype],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    peaks["ratio"] = peaks["logits+ce"] / peaks["fused"]
    return peaks


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on GPU, float32 for --cpu-memory",
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument(
        "--cpu-memory", action="store_true", help="fused linear CE peak-memory comparison on CPU"
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--_rss-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._rss_child:
        mode, tokens, hidden, vocab, dtype = args._rss_child
        _rss_peak_child(mode, int(tokens), int(hidden), int(vocab), dtype)
        return 0
    if args.cpu_memory:
        r = cpu_memory_comparison(args.tokens, args.hidden, args.vocab, args.dtype or "float32")
        print(
            f"fused linear CE, tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} "
            f"{args.dtype or 'float32'}, CPU peak RSS above inputs:"
        )
        print(
            f"  logits + CE: {r['logits+ce'] / 2**20:.1f} MiB   fused: {r['fused'] / 2**20:.1f} MiB   "
            f"ratio: {r['ratio']:.1f}x"
        )
        return 0
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
            return 2
        run_benchmarks(SMOKE, "cpu", torch.float32, reps=1, compile_ok=False)
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU to benchmark the Triton kernels; none found, nothing to do.")
        return 0
    run_benchmarks(
        LLAMA3_8B, "cuda", getattr(torch, args.dtype or "bfloat16"), args.reps, not args.no_compile
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
