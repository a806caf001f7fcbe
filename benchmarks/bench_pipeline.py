"""Pipeline schedules on gloo: our executor against torch.distributed.pipelining, same stages, same data.

For v = 1, v = 2 and the V placement (two chunks per rank, stages r and 2 pp - 1 - r) every rank builds
the same model and cuts the same chunks (balanced by FLOPs, as training does); our PipelineExecutor (1F1B,
interleaved 1F1B and interleaved zero-bubble, ZB-V, DualPipeV, plus GPipe and ZB-H1) and torch's
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
ScheduleDualPipeV then run the same micro-batches on those very modules, alternating step by step so both
see the same machine load.
Prints median step times and our/torch ratios, and for our schedules the bubble fraction measured from a
per-action trace beside the one the simulator predicts replaying the traced durations with the measured
dispatch overhead and transfer latency; "traced/bound" is the traced step over the schedule's compute
bound (the simulated step with free transfers and no overhead), which no executor of that schedule can
go below.

    python benchmarks/bench_pipeline.py --pp 2 --microbatches 8 --timeline bench_interleaved.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmtrain.config import ModelConfig, ParallelConfig
from llmtrain.models import build
from llmtrain.parallel import Topology
from llmtrain.pipeline.executor import PipelineExecutor
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import SimulationResult, simulate
from llmtrain.pipeline.stages import activation_shape, build_stages
from llmtrain.pipeline.timeline import Span, bubble_fraction, render_png, save_trace
from llmtrain.planner.cost.flops import head_cost_in_layers


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _consecutive(spans: list[Span]) -> list[tuple[Span, Span]]:
    """Every pair of computes that follow each other on one rank."""
    pairs = []
    for rank in {s.rank for s in spans}:
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
        pairs += list(zip(mine, mine[1:], strict=False))
    return pairs


def _transfer_latency(schedule, spans: list[Span]) -> float:
    """Median delay from the end of a forward to the start of the next stage's forward on another rank,
    where that rank sat idle waiting for it: the transfer time the simulator should charge."""
    by_key = {(s.kind, s.microbatch, schedule.stage(s.rank, s.chunk)): s for s in spans}
    previous_end = {(after.rank, after.start): before.end for before, after in _consecutive(spans)}
    delays = []
    for (kind, mb, stage), s in by_key.items():
        producer = by_key.get((kind, mb, stage - 1)) if kind == "F" else None
        if producer is None or producer.rank == s.rank:
            continue
        if previous_end.get((s.rank, s.start), 0.0) < producer.end < s.start:
            delays.append(s.start - producer.end)
    return statistics.median(delays) if delays else 0.0


def _dispatch_overhead(spans: list[Span]) -> float:
    """Median gap between two consecutive computes of a rank: the executor's own time per action (the
    longer gaps, where a rank waited for data, are the minority the median ignores)."""
    gaps = [after.start - before.end for before, after in _consecutive(spans)]
    return statistics.median(gaps) if gaps else 0.0


def _simulate(schedule, spans: list[Span], free_transfers: bool = False) -> SimulationResult:
    """The simulator's replay of this schedule with every action's traced duration, the measured
    per-action dispatch overhead and the transfer latency beyond it; with ``free_transfers`` both are zero,
    which gives the compute-bound step time no executor of this schedule can beat on these durations."""
    durations = {(s.rank, s.kind, s.microbatch, s.chunk): s.end - s.start for s in spans}
    overhead = 0.0 if free_transfers else _dispatch_overhead(spans)
    p2p = 0.0 if free_transfers else max(_transfer_latency(schedule, spans) - overhead, 0.0)
    # The tables are unused (every action has its own duration) but must be well-formed.
    return simulate(schedule, 1.0, 2.0, weight_grad=1.0, p2p=p2p, overhead=overhead, action_costs=durations)


CONFIGS = [
    (1, False, ["1f1b", "gpipe", "zb_h1"], ["Schedule1F1B"]),
    (
        2,
        False,
        ["interleaved_1f1b", "interleaved_zb"],
        ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"],
    ),
    (2, True, ["zb_v", "dualpipe_v"], ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"]),
]
"""(chunks per rank, V placement, our schedules, torch's) run on one set of stages each."""
ROWS = [
    ("1f1b", "Schedule1F1B"),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B"),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble"),
    ("zb_v", "ScheduleZBVZeroBubble"),
    ("dualpipe_v", "ScheduleDualPipeV"),
    ("gpipe", None),
    ("zb_h1", None),
]
"""Printed rows: our schedule and torch's of the same order (None: torch has none)."""


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    topo = Topology(ParallelConfig(pp=world), world, rank)
    cfg = ModelConfig(
        arch="llama",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        vocab_size=args.vocab,
        seq_length=args.seq,
        kernels="torch",
    )
    m, b = args.microbatches, args.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_length + 1), generator=gen)
    micro = list(batch.split(b))
    shape = activation_shape(b, cfg.seq_length, cfg.hidden_size)
    out: dict[str, object] = {}
    for v, v_shape, ours_names, theirs_names in CONFIGS:
        torch.manual_seed(1234)
        # The split training uses: layers balanced against the output layer's FLOPs.
        stages = build_stages(build(cfg), topo, v, head_cost=head_cost_in_layers(cfg), v_shape=v_shape)
        torch_stages = [
            PipelineStage(chunk, chunk.stage, world * v, torch.device("cpu"), group=topo.pp_group)
            for chunk in stages.chunks
        ]
        holds_first = any(chunk.is_first for chunk in stages.chunks)
        holds_last = any(chunk.is_last for chunk in stages.chunks)

        def torch_step(theirs, first: bool = holds_first, last: bool = holds_last) -> None:
            kwargs = {"target": batch[:, 1:]} if last else {}
            if first:
                theirs.step(batch[:, :-1], **kwargs)
            else:
                theirs.step(**kwargs)

        executors = {
            name: PipelineExecutor(stages, build_schedule(name, world, m, v), topo, shape)
            for name in ours_names
        }
        runs = {name: (lambda ex=ex: ex.run(micro)) for name, ex in executors.items()}
        for cls_name in theirs_names:
            cls = getattr(torch_schedules, cls_name)
            theirs = cls(torch_stages[0] if v == 1 else torch_stages, m, loss_fn=_loss)
            runs[cls_name] = lambda theirs=theirs: torch_step(theirs)
        times: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for step in range(args.warmup + args.steps):
            # Rotate who goes first, so drifting machine load favours no one.
            for name in order[step % len(order) :] + order[: step % len(order)]:
                stages.zero_grad(set_to_none=True)
                t = _timed(runs[name])
                if step >= args.warmup:
                    times[name].append(t)
        for name, ex in executors.items():
            traced = []
            for _ in range(args.traced_steps):
                stages.zero_grad(set_to_none=True)
                dist.barrier()
                ex.run(micro, trace=True)
                gathered: list = [None] * world
                dist.all_gather_object(gathered, ex.trace)
                traced.append([Span(**e) for trace in gathered for e in trace])
            out[name] = {
                "time": statistics.median(times[name]),
                "best": min(times[name]),
                # Each traced step against its own replay; the median over the traced steps, as for times.
                "measured_bubble": statistics.median(bubble_fraction(spans) for spans in traced),
                "simulated_bubble": statistics.median(
                    _simulate(ex.schedule, spans).bubble_fraction for spans in traced
                ),
                # How close the traced steps came to the compute bound of their schedule.
                "traced/bound": statistics.median(
                    (max(s.end for s in spans) - min(s.start for s in spans))
                    / _simulate(ex.schedule, spans, free_transfers=True).step_time
                    for spans in traced
                ),
                "spans": traced[-1],
            }
        for cls_name in theirs_names:
            out[cls_name] = (statistics.median(times[cls_name]), min(times[cls_name]))
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the comparison on `--pp` gloo processes and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--traced-steps", type=int, default=5, help="traced steps per schedule (bubble)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeline", help="PNG of the traced interleaved run")
    parser.add_argument(
        "--trace-out", help="trace JSON of the interleaved run (for tools/show_schedule.py --trace)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            _worker, args=(args.pp, os.path.join(tmp, "store"), args, results), nprocs=args.pp, join=True
        )
        r = dict(results)
    print(
        f"pp={args.pp} microbatches={args.microbatches} micro_batch_size={args.micro_batch_size} "
        f"layers={args.layers} hidden={args.hidden} seq={args.seq} threads/rank={args.threads} (gloo, CPU)"
    )
    print(
        f"{'schedule':<18}{'median s':>10}{'best s':>9}{'torch med':>10}{'torch best':>11}{'ratio med':>10}"
        f"{'ratio best':>11}{'bubble meas.':>14}{'bubble sim.':>13}{'traced/bound':>14}"
    )
    for name, torch_key in ROWS:
        row = r[name]
        line = f"{name:<18}{row['time']:10.4f}{row['best']:9.4f}"
        if torch_key:
            med, best = r[torch_key]
            line += f"{med:10.4f}{best:11.4f}{row['time'] / med:10.3f}{row['best'] / best:11.3f}"
        else:
            line += " " * 42
        print(
            line + f"{row['measured_bubble']:14.3f}{row['simulated_bubble']:13.3f}{row['traced/bound']:14.3f}"
        )
    if args.timeline:
        spans = r["interleaved_1f1b"]["spans"]
        title = (
            f"interleaved_1f1b pp={args.pp} m={args.microbatches} v=2 (traced, gloo)  bubble "
            f"{r['interleaved_1f1b']['measured_bubble']:.1%}, "
            f"simulated {r['interleaved_1f1b']['simulated_bubble']:.1%}"
        )
        render_png(spans, args.timeline, title, "seconds")
        print(f"wrote {args.timeline}")
    if args.trace_out:
        save_trace(r["interleaved_1f1b"]["spans"], args.trace_out)
        print(f"wrote {args.trace_out}")


if __name__ == "__main__":
    main()
