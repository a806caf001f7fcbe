"""Context parallelism on this machine: activation memory per rank against parallel.cp, and ring attention's
speed and overlap against one rank.

Memory. tools/pretrain.py (torchrun, gloo, logging.memory=true) trains the same LLaMA on the same sequence
at parallel.cp = 1, 2, 4 (cp ranks, dp 1) and every rank's step peak is read from metrics.jsonl (the bytes
of live tensors, llmtrain.training.memory_tracking). What no split shrinks is the static part: the fp32
parameters, their fp32 gradient buffer and Adam's two moments, 4 x 4 bytes per parameter on every rank.
Activations = peak - static; the expectation is activations(1) / cp. What ring attention adds on top is
bounded by `ring_extra_bytes`: the PyTorch block path's fp32 score-sized temporaries of one (query chunk,
key chunk) pair at a time, and the K/V (and dK/dV) in flight.

Speed. One sequence of --seq tokens through a --layers LLaMA, forward + backward of the loss, on one rank and
at cp = 2 and 4 (spawned gloo processes, ring attention); the slowest rank's time, median over --repeats
rounds (the variants of a round run back to back, so load from other processes hits them alike). Overlap:
the same cp run with the ring's transfers replaced by local copies (the benchmark patches
context_parallel._exchange; the blocks then compute on this rank's own K/V, the same work) gives the time
without communication; replaying the step's recorded transfers alone gives the communication time, and the
time the step blocks in the transfers' wait() (the slowest rank's) the exposed part of it:
overlap = 1 - exposed / communication. The exposed time is measured directly because the difference of the
two step times is within the noise of a shared machine when the communication is small. On a CPU the cp
processes share the cores, so cp > 1 is not faster here; the ratios say what the ring costs over the same
work on one rank.

  python benchmarks/bench_cp.py                      # memory at cp 1, 2, 4 and speed at cp 2, 4
  python benchmarks/bench_cp.py --skip-memory --seq 16384 --layers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig, ParallelConfig, load
from llmtrain.parallel import Topology
from llmtrain.parallel import context_parallel as cpmod
from llmtrain.parallel.context_parallel import apply_cp
from llmtrain.planner.profile import run_local_workers

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
    PyTorch block path's fp32 temporaries of one pair of chunks (n = seq / 2cp queries and keys; at most
    four (b, heads, n, n) score-sized tensors at once: scores, probabilities, dP and dS in the backward)
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


def speed_job(seq: int, layers: int, cp: int) -> JobConfig:
    """A LLaMA of llama-small's width with `layers` layers over one sequence of `seq` tokens."""
    model = ModelConfig(
        arch="llama",
        num_layers=layers,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=4,
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


class _TimedWait:
    """A transfer whose wait() adds the seconds it blocks to `waited[0]`."""

    def __init__(self, work: Any, waited: list[float]) -> None:
        self.work, self.waited = work, waited

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        self.waited[0] += time.perf_counter() - start


def _speed_worker(rank: int, world: int, port: int, seq: int, layers: int, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        job = speed_job(seq, layers, world)
        topo = Topology(job.parallel, world, rank)
        model, tokens = _model(job, topo), _tokens(job)
        split = model.context
        real = cpmod._exchange
        sends: list[list[torch.Tensor]] = []  # the transfers of one step, recorded
        waited = [0.0]  # seconds blocked in the transfers' wait() (communication not hidden by compute)

        def recording(split: Any, tensors: list[torch.Tensor], detail: str) -> tuple[list, list]:
            sends.append([torch.empty_like(t) for t in tensors])
            return real(split, tensors, detail)

        def timing(split: Any, tensors: list[torch.Tensor], detail: str) -> tuple[list, list]:
            works, received = real(split, tensors, detail)
            return [_TimedWait(w, waited) for w in works], received

        def replay() -> None:
            for tensors in sends:
                for work in real(split, tensors, "bench_cp replay")[0]:
                    work.wait()

        with _exchange_replaced(recording):
            _step(model, tokens)  # warm-up
        with _exchange_replaced(_local_copies):
            _step(model, tokens)
        times: dict[str, list[float]] = {"with": [], "without": [], "comm": [], "waited": []}
        for _ in range(repeats):
            waited[0] = 0.0
            with _exchange_replaced(timing):
                times["with"].append(_timed(lambda: _step(model, tokens), topo.cp_group))
            times["waited"].append(_slowest(waited[0], topo.cp_group))
            with _exchange_replaced(_local_copies):
                times["without"].append(_timed(lambda: _step(model, tokens), topo.cp_group))
            times["comm"].append(_timed(replay, topo.cp_group))
        if rank == 0:
            sent = sum(t.numel() * t.element_size() for tensors in sends for t in tensors)
            out.put({k: statistics.median(v) for k, v in times.items()} | {"bytes": sent})
    finally:
        dist.destroy_process_group()


def one_rank_seconds(seq: int, layers: int, repeats: int) -> float:
    """The same model and sequence, forward + backward on one process (no cp): median seconds."""
    job = speed_job(seq, layers, 1)
    model, tokens = _model(job, None), _tokens(job)
    _step(model, tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(model, tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed_table(seq: int, layers: int, cps: list[int], repeats: int) -> list[dict[str, Any]]:
    """Per cp: seconds with and without the ring's communication, the communication alone, the time blocked
    waiting for it (exposed), one rank's seconds, and overlap = 1 - exposed / communication."""
    torch.set_num_threads(1)
    single = one_rank_seconds(seq, layers, repeats)
    rows = []
    for cp in cps:
        raw = run_local_workers(_speed_worker, cp, seq, layers, repeats)
        overlap = 1.0 - min(1.0, raw["waited"] / raw["comm"]) if raw["comm"] > 0 else 1.0
        rows.append({"cp": cp, "one_rank": single, **raw, "overlap": overlap})
    return rows


def print_speed(rows: list[dict[str, Any]], seq: int, layers: int) -> None:
    print(
        f"\nforward + backward of one sequence of {seq} tokens, llama {layers} layers x 256, ring attention "
        "(seconds, slowest rank, median)"
    )
    print(
        f"{'cp':>3}{'one rank':>10}{'cp ranks':>10}{'vs one':>8}{'no comm':>9}{'comm alone':>12}"
        f"{'exposed':>9}{'overlap':>9}{'MiB sent':>10}"
    )
    for r in rows:
        print(
            f"{r['cp']:>3}{r['one_rank']:>10.3f}{r['with']:>10.3f}{r['with'] / r['one_rank']:>8.2f}"
            f"{r['without']:>9.3f}{r['comm']:>12.3f}{r['waited']:>9.3f}{r['overlap']:>9.2f}"
            f"{r['bytes'] / MIB:>10.1f}"
        )


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
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the speed runs")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    if args.memory_cps[0] != 1:
        parser.error("--memory-cps must start with 1 (the baseline)")
    results: dict[str, Any] = {}
    if not args.skip_memory:
        results["memory"] = memory_table(args.memory_seq, args.memory_layers, args.memory_cps, args.steps)
        print_memory(results["memory"], args.memory_seq, args.memory_layers)
    if not args.skip_speed:
        results["speed"] = speed_table(args.seq, args.layers, args.cps, args.repeats)
        print_speed(results["speed"], args.seq, args.layers)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
