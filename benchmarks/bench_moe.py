"""Time one MoE block forward+backward: llmtrain's MoEMLP (kernels.moe_experts, model.kernels=auto) against
transformers' MixtralSparseMoeBlock holding the same weights, in the same run, with transformers' default
experts implementation ("grouped_mm", which calls torch.nn.functional.grouped_mm) and with its per-expert
loop ("eager"); in fp32 and bf16. A further section times the token dispatch alone (routing, sort, gather,
weighted combine; the experts replaced by the identity). With `--ep`, a last section runs the same block
under expert parallelism on that many gloo processes (one thread each): every rank routes its own `tokens`
and holds experts/ep of the experts (llmtrain.parallel.expert_parallel.apply_ep), against the whole block
at ep=1 on the same tokens in the same processes; it shows the slowest rank's median step, the part of it
spent in the all-to-alls (counts, rows and their gradients, including the wait for peers), and ep/ep=1.

Before timing, each dtype checks that llmtrain's output and gradients match transformers' grouped_mm block.
Each rep times the implementations back to back (interleaved, so a load change on a shared machine hits
them alike); the table shows medians of the wall clock and of this process's CPU time, and the ratios of the
transformers times to ours (> 1: ours faster). On a loaded machine, `--threads 1` makes the CPU time the work
done (no barrier spinning), the steadier comparison.

  python benchmarks/bench_moe.py                        # CPU, every preset, fp32 and bf16
  python benchmarks/bench_moe.py --preset mixtral --reps 9 --threads 1
  python benchmarks/bench_moe.py --preset fine --dtype fp32 --ep 2 4   # with the expert-parallel section
  python benchmarks/bench_moe.py --smoke                # tiny shapes, one rep: checks the harness runs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from llmtrain.config import ModelConfig, ParallelConfig  # noqa: E402
from llmtrain.models import build  # noqa: E402, F401  (registers the archs)
from llmtrain.models.moe import MoEMLP  # noqa: E402
from llmtrain.models.registry import get_arch  # noqa: E402
from llmtrain.parallel import Topology, apply_ep, expert_parallel  # noqa: E402
from tests.parallel._dist import spawn  # noqa: E402  (the gloo launcher the parallel tests use)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE block: tokens through it, hidden and expert widths, experts and top-k."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int


PRESETS = {
    # Mixtral-style: few wide experts (Mixtral-8x7B's 8 experts, top-2, ffn 3.5x hidden, scaled down).
    "mixtral": Shape(tokens=4096, hidden=512, ffn=1024, experts=8, top_k=2),
    # Fine-grained, as Qwen3-MoE / ERNIE-4.5-MoE / DeepSeek-V3 (many narrow experts, top-8, scaled down).
    "fine": Shape(tokens=4096, hidden=512, ffn=256, experts=32, top_k=8),
    # Many experts, as Qwen3-30B-A3B (128 experts, top-8, expert ffn 0.375x hidden) or DeepSeek-V3 (256),
    # scaled down: 256 routed rows per expert, where per-expert work is small and its overheads show.
    "many": Shape(tokens=4096, hidden=512, ffn=192, experts=128, top_k=8),
}
SMOKE = Shape(tokens=64, hidden=32, ffn=48, experts=4, top_k=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Agreement with transformers' block on the same weights: both round the same products once to the dtype
# but sum them in different orders, so they differ by a few units in the last place of outputs of O(1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def build_blocks(shape: Shape, dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Module, MoEMLP]:
    """transformers' MixtralSparseMoeBlock with random weights and llmtrain's MoEMLP holding copies."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(seed)
    hf_cfg = MixtralConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
    )
    hf = MixtralSparseMoeBlock(hf_cfg)
    # Weights scaled so each layer's output is O(1) for O(1) inputs, as a trained block roughly is.
    torch.nn.init.normal_(hf.gate.weight, std=shape.hidden**-0.5)
    torch.nn.init.normal_(hf.experts.gate_up_proj, std=shape.hidden**-0.5)
    torch.nn.init.normal_(hf.experts.down_proj, std=shape.ffn**-0.5)
    cfg = ModelConfig(
        arch="mixtral",
        hidden_size=shape.hidden,
        num_attention_heads=1,
        ffn_hidden_size=shape.ffn,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
    )
    ours = MoEMLP(get_arch("mixtral"), cfg)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return hf.to(dtype), ours.to(dtype)


def _run_hf(block: torch.nn.Module, impl: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        # Standalone blocks read the experts implementation from their config; a PreTrainedModel would set
        # it from from_pretrained(..., experts_implementation=...), "grouped_mm" by default.
        block.experts.config._experts_implementation = impl
        return block(x)

    return run


def forward_backward(fn: Callable, module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list:
    """Output and the gradients (input first, then parameters) of <fn(x), dy>; gradients start from None."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    out = fn(x)
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in module.parameters() if p.grad is not None]


def check_match(hf: torch.nn.Module, ours: MoEMLP, x: torch.Tensor, dy: torch.Tensor) -> float:
    """Largest difference between our block and transformers' grouped_mm block (output and gradients),
    relative to each tensor's largest magnitude; raises beyond the dtype's tolerance."""
    got = forward_backward(ours, ours, x, dy)
    exp = forward_backward(_run_hf(hf, "grouped_mm"), hf, x, dy)
    worst = 0.0
    for name, a, e in zip(["output", "dx", "router", "gate_up", "down"], got, exp, strict=True):
        err = ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-30)).item()
        if err > TOLERANCE[x.dtype]:
            raise AssertionError(f"{name}: llmtrain and transformers differ by {err:.2e} (relative)")
        worst = max(worst, err)
    return worst


@dataclasses.dataclass(frozen=True)
class Timing:
    """Medians over the reps of one implementation, in milliseconds."""

    wall: float
    cpu: float
    """This process's CPU time (all its threads): on a machine other jobs load, the work done, where the
    wall clock also counts waiting for a core. With several threads it includes their barrier spinning."""


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, Timing]:
    """Median wall and CPU milliseconds of each fn over `reps` rounds that run every fn once, after `warmup`
    rounds."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            if i >= warmup:
                wall[name].append((time.perf_counter() - start) * 1e3)
                cpu[name].append((time.process_time() - start_cpu) * 1e3)
    return {name: Timing(statistics.median(wall[name]), statistics.median(cpu[name])) for name in fns}


def _row(name: str, t: Timing, ours: Timing | None = None) -> str:
    line = f"  {name:<28} {t.wall:9.1f} ms wall {t.cpu:9.1f} ms cpu"
    if ours is not None:
        line += f"   {t.wall / ours.wall:5.2f}x / {t.cpu / ours.cpu:5.2f}x ours (wall / cpu)"
    return line


def bench_block(shape: Shape, dtype: torch.dtype, reps: int, warmup: int) -> dict[str, Timing]:
    hf, ours = build_blocks(shape, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape.tokens, shape.hidden, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(1, shape.tokens, shape.hidden, generator=gen).to(dtype)
    err = check_match(hf, ours, x, dy)
    print(f"  llmtrain vs transformers grouped_mm: max relative difference {err:.1e} (output, grads)")
    times = time_interleaved(
        {
            "llmtrain (auto)": lambda: forward_backward(ours, ours, x, dy),
            "transformers grouped_mm": lambda: forward_backward(_run_hf(hf, "grouped_mm"), hf, x, dy),
            "transformers eager": lambda: forward_backward(_run_hf(hf, "eager"), hf, x, dy),
        },
        reps,
        warmup,
    )
    ours = times["llmtrain (auto)"]
    for name, t in times.items():
        print(_row(name, t, None if t is ours else ours))
    return times


def bench_dispatch(shape: Shape, dtype: torch.dtype, reps: int, warmup: int) -> dict[str, Timing]:
    """The MoE block's token movement alone: routing, sort by expert, gather, weighted combine (forward and
    backward), with kernels.moe_experts replaced by the identity."""
    _, ours = build_blocks(shape, dtype)
    x = torch.randn(1, shape.tokens, shape.hidden).to(dtype).requires_grad_()
    dy = torch.randn(1, shape.tokens, shape.hidden).to(dtype)
    with mock.patch.object(kernels, "moe_experts", lambda rows, *args, **kwargs: rows):
        times = time_interleaved(
            {"local dispatch": lambda: forward_backward(ours, ours, x, dy)}, reps, warmup
        )
    print(_row("local dispatch (no experts)", times["local dispatch"]))
    return times


@dataclasses.dataclass(frozen=True)
class EpTiming:
    """One rank's medians over the reps, in milliseconds: the block at ep=1 and under EP, and the part of
    the EP step spent in its all-to-alls."""

    whole: float
    ep: float
    exchange: float


def _ep_rank(rank: int, world: int, shape: Shape, dtype: torch.dtype, reps: int, warmup: int) -> EpTiming:
    """This rank's timings: the same weights on every rank, its own tokens, ep = world."""
    _, whole = build_blocks(shape, dtype)
    _, sharded = build_blocks(shape, dtype)
    apply_ep(sharded, Topology(ParallelConfig(ep=world), world, rank))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, shape.tokens, shape.hidden, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(1, shape.tokens, shape.hidden, generator=gen).to(dtype)
    exchange = [0.0]
    all_to_all = expert_parallel._all_to_all

    def timed_all_to_all(*args: object, **kwargs: object) -> torch.Tensor:
        start = time.perf_counter()
        out = all_to_all(*args, **kwargs)
        exchange[0] += time.perf_counter() - start
        return out

    times: dict[str, list[float]] = {"whole": [], "ep": [], "exchange": []}
    with mock.patch.object(expert_parallel, "_all_to_all", timed_all_to_all):
        for i in range(warmup + reps):
            for name, block in (("whole", whole), ("ep", sharded)):
                dist.barrier()  # every rank starts together: the EP step's waits are its own
                exchange[0] = 0.0
                start = time.perf_counter()
                forward_backward(block, block, x, dy)
                if i >= warmup:
                    times[name].append((time.perf_counter() - start) * 1e3)
            if i >= warmup:
                times["exchange"].append(exchange[0] * 1e3)
    return EpTiming(*(statistics.median(times[k]) for k in ("whole", "ep", "exchange")))


def bench_ep(
    shape: Shape, dtype: torch.dtype, degrees: list[int], reps: int, warmup: int
) -> dict[int, EpTiming]:
    """The slowest rank's timings of the block under each EP degree (see the module docstring)."""
    results = {}
    for ep in degrees:
        ranks = spawn(ep, _ep_rank, shape, dtype, reps, warmup)
        t = max(ranks, key=lambda t: t.ep)
        results[ep] = t
        print(
            f"  ep={ep} ({ep} processes, 1 thread each, {shape.tokens} tokens per rank, slowest rank): "
            f"ep=1 {t.whole:.1f} ms, ep={ep} {t.ep:.1f} ms ({t.ep / t.whole:.2f}x ep=1), "
            f"of which all-to-all {t.exchange:.1f} ms ({t.exchange / t.ep:.0%}), "
            f"rest {t.ep - t.exchange:.1f} ms"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], default="all")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one rep, no warm-up")
    parser.add_argument(
        "--ep", type=int, nargs="*", default=[], help="expert-parallel degrees to time (gloo processes)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = (
        {"smoke": SMOKE}
        if args.smoke
        else PRESETS
        if args.preset == "all"
        else {args.preset: PRESETS[args.preset]}
    )
    reps, warmup = (1, 0) if args.smoke else (args.reps, args.warmup)
    dtypes = DTYPES if args.dtype == "all" else {args.dtype: DTYPES[args.dtype]}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.2f}")
    print(f"median of {reps} forward+backward reps after {warmup} warm-up")
    for preset, shape in shapes.items():
        for dname, dtype in dtypes.items():
            print(f"== {preset} {dname}: {shape}")
            bench_block(shape, dtype, reps, warmup)
            bench_dispatch(shape, dtype, reps, warmup)
            if args.ep:
                bench_ep(shape, dtype, args.ep, reps, warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
