"""Context parallelism on this machine: activation memory per rank against parallel.cp, and ring attention's
speed and overlap against one rank.

Memory. tools/pretrain.py (torchrun, gloo, logging.memory=true) trains the same LLaMA on the same sequence
at parallel.cp = 1, 2, 4 (cp ranks, dp 1) and every rank's step peak is read from metrics.jsonl (the bytes
of live tensors, llmtrain.training.memory_tracking). What no split shrinks is the static part: the fp32
parameters, their fp32 gradient buffer and Adam's two moments, 4 x 4 bytes per parameter on every rank.
Activations = peak - static; the expectation is activations(1) / cp. What ring attention adds on top is
bounded by `ring_extra_bytes`: the explicit PyTorch block path's fp32 score-sized temporaries of one (query
chunk, key chunk) pair at a time (on CPU the fused kernel holds none, so the bound is loose there), and the
K/V (and dK/dV) in flight.

Speed. One sequence of --seq tokens through a --layers LLaMA (--kv-heads of its 8 heads), forward + backward
of the loss, on one rank and at cp = 2 and 4 (spawned gloo processes, ring attention): the slowest rank's
seconds, median and range over --repeats rounds. A round runs three variants back to back, so load from
other processes hits them alike:
  with      the ring as it is;
  without   the ring's transfers replaced by local copies (the benchmark patches context_parallel._exchange;
            the blocks compute on this rank's own K/V, the same work). with - without (paired per round) is
            what the communication costs the step: on a CPU the transfers' copies also take cycles from the
            same cores, so hidden transfers are not free;
  comm      the step's recorded transfers replayed alone: the communication time to hide.
Overlap = 1 - exposed / comm, from the timeline of every transfer of the `with` step (posted, first waited
for, wait returned; one monotonic clock for the processes of the machine): a rank's time blocked in wait()
is split by split_waits into skew, while a ring neighbour had not yet posted the same exchange (the ranks
drifting apart: a gloo transfer starts only when both ends are in it, so this is not communication), and
exposed, after the rank's own compute was done and both neighbours had posted (transfer time not hidden
behind compute). The last transfer of each attention backward (dK/dV sent home) has no compute left to hide
behind, so the overlap of the others is printed too: 1 - (exposed - exposed home) / (comm - comm home). The
difference with - without stays within the noise of a shared machine when the communication is a few
percent of the step, which is why the exposed time is measured directly.
Every process runs one thread: on a 2-core machine cp = 2 has twice one rank's cores, and cp = 4
oversubscribes them (a transfer then also waits for its sender to be scheduled).

Blocks. The ring's attention work without communication, in one process and one thread (block_table):
causal attention forward + backward over --seq tokens by one SDPA call, against the same work done as the
ring's blocks at each cp (every visible chunk pair, merged by log-sum-exp, then every pair's gradients) by
the fused CPU kernel (what the ring runs on CPU) and by the explicit path (matmul + softmax with score-sized
temporaries, what it ran before and still runs on other devices).

  python benchmarks/bench_cp.py                      # memory at cp 1, 2, 4; speed and blocks at cp 2, 4
  python benchmarks/bench_cp.py --skip-memory --cps 2 4 --seq 2048 --kv-heads 8 --layers 2 --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from kernels import cpu_attention, reference
from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig, ParallelConfig, load
from llmtrain.parallel import Topology
from llmtrain.parallel import context_parallel as cpmod
from llmtrain.parallel.context_parallel import apply_cp
from llmtrain.planner.calibration.profile import run_local_workers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import CONFIG, measure  # noqa: E402

MIB = 2**20
STATIC_BYTES_PER_PARAM = 16  # fp32 parameter, fp32 gradient buffer, Adam's exp_avg and exp_avg_sq


def memory_overrides(seq: int, layers: int, cp: int) -> list[str]:
    """The memory run: configs/llama-small.yaml with `layers` layers, one `seq`-token sequence per step."""
    return [
        f"model.num_layers={layers}",
        f"model.seq_length={seq}",
        f"parallel.cp={cp}",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        "train.eval_interval=0",
        "train.num_threads=1",
        "train.warmup_steps=1",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "logging.interval=1",
        "logging.memory=true",
    ]


def parameter_count(job: JobConfig) -> int:
    """Parameters of the job's model (built on meta: no storage)."""
    return sum(p.numel() for p in models.empty_model(job.model, device="meta").parameters())


def ring_extra_bytes(job: JobConfig, cp: int) -> int:
    """Upper bound of the bytes ring attention holds beyond activations(1) / cp on a rank (0 at cp 1): the
    explicit PyTorch block path's fp32 temporaries of one pair of chunks (n = seq / 2cp queries and keys; at
    most four (b, heads, n, n) score-sized tensors at once: scores, probabilities, dP and dS in the
    backward; the fused CPU kernel's blocks hold none)
    plus the K/V block and its dK/dV in flight (received copies, fp32, (2, b, kv_heads, seq / cp, d) each,
    two of each kind)."""
    if cp == 1:
        return 0
    m = job.model
    b, n = job.train.micro_batch_size, m.seq_length // (2 * cp)
    scores = 4 * b * m.num_attention_heads * n * n * 4
    kv = 4 * 2 * b * m.kv_heads * (m.seq_length // cp) * m.head_size * 4
    return scores + kv


def memory_table(seq: int, layers: int, cps: list[int], steps: int) -> list[dict[str, Any]]:
    """Per cp: every rank's step peak, the static bytes, activations (fullest rank), the expectation
    activations(1) / cp and the ring's extra bound. cps[0] must be 1."""
    rows = []
    for cp in cps:
        overrides = memory_overrides(seq, layers, cp)
        job = load(CONFIG, overrides)
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure(CONFIG, overrides, cp, steps, Path(tmp))
        static = STATIC_BYTES_PER_PARAM * parameter_count(job)
        activations = measured["steady"] - static
        base = rows[0]["activations"] if rows else activations
        rows.append(
            {
                "cp": cp,
                "rank_peaks_mib": measured["ranks"],
                "static": static,
                "activations": activations,
                "expected": base / cp,
                "ring_extra": ring_extra_bytes(job, cp),
            }
        )
    return rows


def print_memory(rows: list[dict[str, Any]], seq: int, layers: int) -> None:
    print(f"\nactivation memory per rank, llama-small {layers} layers, one sequence of {seq} tokens (MiB)")
    print(f"{'cp':>3}{'static':>9}{'activations':>13}{'act(1)/cp':>11}{'ratio':>7}{'ring bound':>12}  peaks")
    for r in rows:
        act, expected = r["activations"], r["expected"]
        print(
            f"{r['cp']:>3}{r['static'] / MIB:>9.1f}{act / MIB:>13.1f}{expected / MIB:>11.1f}"
            f"{act / expected:>7.3f}{r['ring_extra'] / MIB:>12.1f}  {r['rank_peaks_mib']}"
        )


# --- Speed and overlap ------------------------------------------------------------------------------------


def speed_job(seq: int, layers: int, cp: int, kv_heads: int = 4) -> JobConfig:
    """A LLaMA of llama-small's width (8 heads of 32) with `layers` layers and `kv_heads` K/V heads over one
    sequence of `seq` tokens."""
    model = ModelConfig(
        arch="llama",
        num_layers=layers,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=kv_heads,
        vocab_size=8192,
        seq_length=seq,
    )
    return JobConfig(model=model, parallel=ParallelConfig(cp=cp))


def _model(job: JobConfig, topo: Topology | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.build(job.model)
    return apply_cp(model, topo) if topo is not None else model


def _tokens(job: JobConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, job.model.vocab_size, (1, job.model.seq_length + 1), generator=g)


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(tokens[:, :-1], tokens[:, 1:]).backward()


def _slowest(seconds: float, group: Any) -> float:
    """The largest of every rank's `seconds`."""
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.item()


def _timed(fn: Callable[[], None], group: Any) -> float:
    torch.distributed.barrier(group)
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start, group)


@contextlib.contextmanager
def _exchange_replaced(fn: Callable) -> Iterator[None]:
    with mock.patch.object(cpmod, "_exchange", fn):
        yield


def _local_copies(split: Any, sends: list[torch.Tensor], detail: str) -> tuple[list, list[torch.Tensor]]:
    """_exchange without communication: 'receives' this rank's own tensors (the blocks do the same work)."""
    return [], [t.clone() for t in sends]


@dataclass
class _Transfer:
    """One ring exchange on this rank, in time.monotonic() seconds (one clock for every process of the
    machine): when it was posted, when the rank first waited for it (the compute it overlaps done) and when
    its last wait returned."""

    posted: float
    waiting: float = math.inf
    done: float = -math.inf


class _TimedWait:
    """A transfer's work whose wait() marks its _Transfer."""

    def __init__(self, work: Any, transfer: _Transfer) -> None:
        self.work, self.transfer = work, transfer

    def wait(self) -> None:
        start = time.monotonic()
        self.work.wait()
        self.transfer.waiting = min(self.transfer.waiting, start)
        self.transfer.done = max(self.transfer.done, time.monotonic())


def split_waits(timelines: list[list[tuple[float, float, float]]]) -> tuple[list[float], list[float]]:
    """Per rank of a ring, the seconds its waits blocked split in two: skew, before both ring neighbours had
    posted the exchange (a transfer starts only when both ends are in it: the ranks drifting apart, not
    communication), and exposed, after the rank's compute was done and both neighbours had posted (the
    transfer not hidden behind compute). timelines[r] holds rank r's (posted, waiting, done) per exchange,
    in the order every rank makes them."""
    cp = len(timelines)
    skew, exposed = [0.0] * cp, [0.0] * cp
    for r, mine in enumerate(timelines):
        for i, (_, waiting, done) in enumerate(mine):
            partners = max(timelines[(r - 1) % cp][i][0], timelines[(r + 1) % cp][i][0])
            skew[r] += max(0.0, min(done, partners) - waiting)
            exposed[r] += max(0.0, done - max(waiting, partners))
    return skew, exposed


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _speed_worker(
    rank: int, world: int, port: int, seq: int, layers: int, kv_heads: int, repeats: int, out: Any
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        job = speed_job(seq, layers, world, kv_heads)
        topo = Topology(job.parallel, world, rank)
        model, tokens = _model(job, topo), _tokens(job)
        split = model.context
        real = cpmod._exchange
        sends: list[list[torch.Tensor]] = []  # the transfers of one step, recorded
        home: list[bool] = []  # which of them send dK/dV home, after the last block: nothing to hide behind
        timeline: list[_Transfer] = []

        def recording(split: Any, tensors: list[torch.Tensor], detail: str) -> tuple[list, list]:
            sends.append([torch.empty_like(t) for t in tensors])
            home.append(detail == cpmod.HOME)
            return real(split, tensors, detail)

        def timing(split: Any, tensors: list[torch.Tensor], detail: str) -> tuple[list, list]:
            transfer = _Transfer(time.monotonic())
            timeline.append(transfer)
            works, received = real(split, tensors, detail)
            return [_TimedWait(w, transfer) for w in works], received

        replayed_home = [0.0]

        def replay() -> None:
            replayed_home[0] = 0.0
            for tensors, is_home in zip(sends, home, strict=True):
                start = time.monotonic()
                for work in real(split, tensors, "bench_cp replay")[0]:
                    work.wait()
                replayed_home[0] += (time.monotonic() - start) * is_home

        with _exchange_replaced(recording):
            _step(model, tokens)  # warm-up
        with _exchange_replaced(_local_copies):
            _step(model, tokens)
        keys = ("with", "without", "comm", "comm_home", "waited", "skew", "exposed", "exposed_home")
        times: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(repeats):
            timeline.clear()
            with _exchange_replaced(timing):
                times["with"].append(_timed(lambda: _step(model, tokens), topo.cp_group))
            mine = [(t.posted, t.waiting, t.done) for t in timeline]
            timelines: list[Any] = [None] * world
            dist.all_gather_object(timelines, mine, group=topo.cp_group)
            skew, exposed = split_waits(timelines)
            _, exposed_home = split_waits([[e for e, h in zip(t, home, strict=True) if h] for t in timelines])
            times["waited"].append(max(sum(d - w for _, w, d in t) for t in timelines))
            times["skew"].append(max(skew))
            times["exposed"].append(max(exposed))
            times["exposed_home"].append(max(exposed_home))
            with _exchange_replaced(_local_copies):
                times["without"].append(_timed(lambda: _step(model, tokens), topo.cp_group))
            times["comm"].append(_timed(replay, topo.cp_group))
            times["comm_home"].append(_slowest(replayed_home[0], topo.cp_group))
        if rank == 0:
            size = [sum(t.numel() * t.element_size() for t in tensors) for tensors in sends]
            cost = [w - wo for w, wo in zip(times["with"], times["without"], strict=True)]
            spreads = {k: _spread(v) for k, v in times.items()} | {"cost": _spread(cost)}
            home_bytes = sum(b for b, h in zip(size, home, strict=True) if h)
            out.put({"spreads": spreads, "bytes": sum(size), "home_bytes": home_bytes})
    finally:
        dist.destroy_process_group()


def one_rank_seconds(seq: int, layers: int, kv_heads: int, repeats: int) -> dict[str, float]:
    """The same model and sequence, forward + backward on one process (no cp): seconds over `repeats`."""
    job = speed_job(seq, layers, 1, kv_heads)
    model, tokens = _model(job, None), _tokens(job)
    _step(model, tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(model, tokens)
        times.append(time.perf_counter() - start)
    return _spread(times)


def _hidden(exposed: float, comm: float) -> float:
    """The share of `comm` seconds of transfers that `exposed` of them left unhidden, within [0, 1]."""
    return 1.0 - min(1.0, max(0.0, exposed) / comm) if comm > 0 else 1.0


def speed_table(
    seq: int, layers: int, cps: list[int], repeats: int, kv_heads: int = 4
) -> list[dict[str, Any]]:
    """Per cp, each over `repeats` rounds (median, min, max): seconds with and without the ring's
    communication and their paired difference (cost), the communication alone, the time blocked in its
    waits split into skew and exposed transfer (split_waits), one rank's seconds, and overlap =
    1 - exposed / communication alone (of the medians), also of the transfers made while blocks compute
    (overlap_hideable: without the dK/dV sent home)."""
    torch.set_num_threads(1)
    single = one_rank_seconds(seq, layers, kv_heads, repeats)
    rows = []
    for cp in cps:
        raw = run_local_workers(_speed_worker, cp, seq, layers, kv_heads, repeats)
        spreads = raw["spreads"] | {"one_rank": single}
        medians = {k: v["median"] for k, v in spreads.items()}
        overlap = _hidden(medians["exposed"], medians["comm"])
        hideable = _hidden(
            medians["exposed"] - medians["exposed_home"], medians["comm"] - medians["comm_home"]
        )
        rows.append(
            {"cp": cp, **medians, "bytes": raw["bytes"], "home_bytes": raw["home_bytes"]}
            | {"overlap": overlap, "overlap_hideable": hideable}
            | {"spread": {k: [v["min"], v["max"]] for k, v in spreads.items()}, "repeats": repeats}
            | {"kv_heads": kv_heads, "load": os.getloadavg()}
        )
    return rows


def print_speed(rows: list[dict[str, Any]], seq: int, layers: int) -> None:
    print(
        f"\nforward + backward of one sequence of {seq} tokens, llama {layers} layers x 256 "
        f"(8 heads, {rows[0]['kv_heads']} K/V heads), ring attention "
        f"(seconds, slowest rank; median [min..max] of {rows[0]['repeats']} rounds)"
    )
    columns = ("one_rank", "with", "without", "cost", "comm", "comm_home", "waited", "skew", "exposed")
    columns += ("exposed_home",)
    names = ("one rank", "cp ranks", "no comm", "with-without", "comm alone", "of it home", "waited", "skew")
    names += ("exposed", "of it home")
    for r in rows:
        print(f"cp={r['cp']}  (load average {' '.join(f'{x:.2f}' for x in r['load'])})")
        for key, name in zip(columns, names, strict=True):
            low, high = r["spread"][key]
            print(f"  {name:>13} {r[key]:8.3f}  [{low:.3f}..{high:.3f}]")
        print(
            f"  cp/one rank {r['with'] / r['one_rank']:.2f}, {r['bytes'] / MIB:.1f} MiB sent, "
            f"overlap {r['overlap']:.2f} (1 - exposed / comm alone); without the dK/dV sent home "
            f"({r['home_bytes'] / r['bytes']:.0%} of the bytes, nothing left to hide them) "
            f"{r['overlap_hideable']:.2f}"
        )


# --- The ring's blocks against one SDPA call -------------------------------------------------------------


def _ring_blocks(
    block: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, cp: int
) -> None:
    """Causal attention forward + backward as ring attention computes it at `cp`, in one process: every
    visible (query chunk, key chunk) pair of the 2cp chunks by `block`'s attention_block, merged by
    log-sum-exp, then every pair's attention_block_grads from the merged output and log-sum-exp."""
    n = q.shape[2] // (2 * cp)
    chunk = lambda t, i: t[:, :, i * n : (i + 1) * n]  # noqa: E731
    pairs = [(i, j) for i in range(2 * cp) for j in range(2 * cp) if cpmod.pair_kind(i, j) != cpmod.MASKED]
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, j in pairs:
        o, lo = block.attention_block(chunk(q, i), chunk(k, j), chunk(v, j), True, None, i * n, j * n, None)
        merged[i] = cpmod._merge(*merged.get(i, (None, None)), o, lo)
    for i, j in pairs:
        out, lse = merged[i]
        block.attention_block_grads(
            chunk(do, i), chunk(q, i), chunk(k, j), chunk(v, j), lse, out, True, None, i * n, j * n, None
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)


def block_table(seq: int, kv_heads: int, cps: list[int], repeats: int) -> list[dict[str, Any]]:
    """Per cp: seconds (median, min, max over `repeats`, one thread) of causal attention forward + backward
    over one sequence of `seq` tokens (8 heads of 32, `kv_heads` K/V heads, fp32) by one SDPA call (torch's
    fused CPU kernel), and by the ring's blocks (_ring_blocks: the same work) with the fused CPU kernel and
    with the explicit path: the blocks' cost over one rank's, without any communication."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 8, seq, 32, generator=g) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, 32, generator=g) for _ in range(2))
    rows = []
    for cp in cps:
        variants = {
            "sdpa": functools.partial(_sdpa, q, k, v, do),
            "fused": functools.partial(_ring_blocks, cpu_attention, q, k, v, do, cp),
            "explicit": functools.partial(_ring_blocks, reference, q, k, v, do, cp),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(repeats):  # the variants of a round back to back, as the speed rounds
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        rows.append({"cp": cp, "load": os.getloadavg()} | {name: _spread(t) for name, t in times.items()})
    return rows


def print_blocks(rows: list[dict[str, Any]], seq: int, kv_heads: int) -> None:
    print(
        f"\ncausal attention forward + backward over {seq} tokens (8 heads of 32, {kv_heads} K/V heads, one "
        "thread): one SDPA call against the ring's blocks in one process (seconds, median [min..max])"
    )
    for r in rows:
        cells = "  ".join(
            f"{name} {r[name]['median']:.3f} [{r[name]['min']:.3f}..{r[name]['max']:.3f}]"
            for name in ("sdpa", "fused", "explicit")
        )
        load = " ".join(f"{x:.2f}" for x in r["load"])
        print(f"cp={r['cp']}  {cells}  (load average {load})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--memory-seq", type=int, default=2048, help="sequence of the memory runs")
    parser.add_argument("--memory-layers", type=int, default=12, help="layers of the memory runs")
    parser.add_argument("--memory-cps", type=int, nargs="+", default=[1, 2, 4], help="cp degrees (first 1)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per memory run")
    parser.add_argument("--seq", type=int, default=8192, help="sequence of the speed runs")
    parser.add_argument("--layers", type=int, default=2, help="layers of the speed runs")
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4], help="cp degrees of the speed runs")
    parser.add_argument("--kv-heads", type=int, default=4, help="K/V heads of the speed runs (of 8 heads)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the speed runs")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-blocks", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    if args.memory_cps[0] != 1:
        parser.error("--memory-cps must start with 1 (the baseline)")
    results: dict[str, Any] = {}
    if not args.skip_memory:
        results["memory"] = memory_table(args.memory_seq, args.memory_layers, args.memory_cps, args.steps)
        print_memory(results["memory"], args.memory_seq, args.memory_layers)
    if not args.skip_speed:
        results["speed"] = speed_table(args.seq, args.layers, args.cps, args.repeats, args.kv_heads)
        print_speed(results["speed"], args.seq, args.layers)
    if not args.skip_blocks:
        results["blocks"] = block_table(args.seq, args.kv_heads, args.cps, args.repeats)
        print_blocks(results["blocks"], args.seq, args.kv_heads)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
