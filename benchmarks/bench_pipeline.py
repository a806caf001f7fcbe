"""Pipeline schedules on gloo: our executor against torch.distributed.pipelining, same stages, same data.

For v = 1, v = 2 and the V placement (two chunks per rank, stages r and 2 pp - 1 - r) every rank builds
the same model and cuts the same chunks (balanced by FLOPs, as training does); our PipelineExecutor (1F1B,
interleaved 1F1B and interleaved zero-bubble, ZB-V, DualPipeV, plus GPipe and ZB-H1) and torch's
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
ScheduleDualPipeV then run the same micro-batches on the same weights (each of our schedules on its own
copy: a split-backward executor reroutes its stages' linear layers), alternating step by step so all see
the same machine load.
Prints three tables: median step times and peak memory per rank (resident memory above the step's start; for
torch's, with its previous step's outputs freed first and its receive buffers, which it keeps between steps,
added) with our/torch ratios; for our schedules the bubble of a traced step beside the simulator's replay of
that same step (llmtrain.pipeline.replay: its own per-action durations, the measured dispatch overhead and
transfer latency), and "traced/bound", the traced step over the schedule's compute bound (the replay with
free transfers and no overhead), which no executor of that schedule can go below; and dualpipe_v's exposed
communication (llmtrain.pipeline.comm_trace) with its transfers posted ahead, as run, against posted only
when needed.
``--moe --ep 2`` instead runs dualpipe_v on a small Mixtral (every layer's experts split over ep ranks,
pp x ep gloo processes) with its overlapped pairs (a forward and another micro-batch's backward taking turns
at the expert all-to-alls, each exchange issued asynchronously) against the same step with each compute run
alone (the executor's ``overlap`` off, every all-to-all synchronous): step times and their ratio, and per step
the all-to-all time exposed (no compute of the process running) and hidden (inside a compute interval).

    python benchmarks/bench_pipeline.py --pp 2 --microbatches 8 --timeline bench_interleaved.png
    python benchmarks/bench_pipeline.py --pp 4 --microbatches 8 --overlap-timeline dualpipe_v_overlap.png
    python benchmarks/bench_pipeline.py --pp 4 --microbatches 8 --v-only
    python benchmarks/bench_pipeline.py --moe --ep 2 --pp 2 --microbatches 8 --overlap-timeline moe.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmtrain.config import ModelConfig, ParallelConfig
from llmtrain.models import build
from llmtrain.parallel import Topology
from llmtrain.parallel.expert_parallel import apply_ep
from llmtrain.pipeline.comm_trace import (
    CommEvent,
    collective_overlap,
    computing,
    exposed,
    hidden_receives,
    in_flight,
    nested_collectives,
)
from llmtrain.pipeline.executor import PipelineExecutor
from llmtrain.pipeline.replay import TOLERANCE, check_bubble, replay
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.stages import activation_shape, build_stages
from llmtrain.pipeline.timeline import Span, render_png, save_trace
from llmtrain.planner.cost.flops import head_cost_in_layers


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rotated_times(runs: dict[str, tuple], warmup: int, steps: int) -> dict[str, list[float]]:
    """Per run name, the times of ``steps`` steps after ``warmup``: each step runs every (owner, step
    function) of ``runs`` once from zeroed gradients, rotating who goes first so that drifting machine load
    favours no one."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for step in range(warmup + steps):
        for name in order[step % len(order) :] + order[: step % len(order)]:
            owner, fn = runs[name]
            owner.zero_grad(set_to_none=True)
            t = _timed(fn)
            if step >= warmup:
                times[name].append(t)
    return times


def _traced_step(ex: PipelineExecutor, micro: list[torch.Tensor]) -> None:
    """One traced step of ``ex`` from zeroed gradients, every rank starting together."""
    ex.stages.zero_grad(set_to_none=True)
    dist.barrier()
    ex.run(micro, trace=True)


def _rss(field: str) -> int:
    """A /proc/self/status memory figure of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_step_memory(fn) -> int:
    """Bytes the process's resident memory rose above its level at the step's start, at its peak (the
    kernel's high-water mark, reset by /proc/self/clear_refs): activations, the weight-gradient stash,
    transfer buffers and gradients alike. main() sets glibc's mmap threshold so freed tensors leave RSS."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    fn()
    peak = _rss("VmHWM") - base
    dist.barrier()
    return peak


def _kept_receive_bytes(stages: list) -> int:
    """Bytes of the receive buffers torch's stages keep between steps: one per micro-batch for activations
    and one for gradients, allocated at their first step (ours allocates each receive's buffer in the step,
    so the step's rise counts it)."""
    tables = [table for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)]
    buffers = [
        getattr(info, "buffer", None) for table in tables for infos in table.values() for info in infos
    ]
    return sum(b.numel() * b.element_size() for b in buffers if b is not None)


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
V_CONFIGS = [(2, False, ["interleaved_zb"], ["ScheduleInterleavedZeroBubble"]), CONFIGS[2]]
"""``--v-only``: the three zero-bubble pairs of issue 35 against torch's, nothing else."""
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
NO_OVERLAP = "dualpipe_v, no overlap"
"""dualpipe_v with every receive posted only when its compute needs it (lookahead 0), nothing overlapped."""


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
    for v, v_shape, ours_names, theirs_names in V_CONFIGS if args.v_only else CONFIGS:

        def fresh(v: int = v, v_shape: bool = v_shape):
            # The split training uses: layers balanced against the output layer's FLOPs. Every schedule gets
            # its own copy of the same weights: a split-backward executor reroutes its stages' linear layers.
            torch.manual_seed(1234)
            return build_stages(build(cfg), topo, v, head_cost=head_cost_in_layers(cfg), v_shape=v_shape)

        stages = fresh()
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
            name: PipelineExecutor(fresh(), build_schedule(name, world, m, v), topo, shape)
            for name in ours_names
        }
        if "dualpipe_v" in ours_names and not args.v_only:
            # The same step with each receive posted only when its compute needs it: nothing overlaps.
            executors[NO_OVERLAP] = PipelineExecutor(
                fresh(), build_schedule("dualpipe_v", world, m, v), topo, shape, lookahead=0
            )
        runs = {name: (ex.stages, lambda ex=ex: ex.run(micro)) for name, ex in executors.items()}
        for cls_name in theirs_names:
            cls = getattr(torch_schedules, cls_name)
            theirs = cls(torch_stages[0] if v == 1 else torch_stages, m, loss_fn=_loss)
            runs[cls_name] = (stages, lambda theirs=theirs: torch_step(theirs))
        times = _rotated_times(runs, args.warmup, args.steps)
        memory = {}
        for name, (owner, fn) in runs.items():
            owner.zero_grad(set_to_none=True)
            kept = 0
            if name in theirs_names:
                # torch frees its last step's outputs (the last stage's logits of every micro-batch) only when
                # its next step starts: freed here first, or the baseline holds memory the step reuses.
                for stage in torch_stages:
                    stage.clear_runtime_states()
                kept = _kept_receive_bytes(torch_stages)
            peak: list = [None] * world
            dist.all_gather_object(peak, _peak_step_memory(fn) + kept)
            memory[name] = peak
        for name, ex in executors.items():
            traced, comms = [], []
            for _ in range(args.traced_steps):
                _traced_step(ex, micro)
                gathered: list = [None] * world
                dist.all_gather_object(gathered, (ex.trace, ex.comm_trace))
                traced.append([Span(**e) for trace, _ in gathered for e in trace])
                comms.append([CommEvent(**e) for _, trace in gathered for e in trace])
            checks = [
                check_bubble(ex.schedule, spans, events) for spans, events in zip(traced, comms, strict=True)
            ]
            out[name] = {
                "time": statistics.median(times[name]),
                "best": min(times[name]),
                "memory": memory[name],
                # Each traced step against its own replay; the median over the traced steps, as for times.
                **{
                    key: statistics.median(getattr(c, key) for c in checks)
                    for key in (
                        "measured",
                        "simulated",
                        "relative_error",
                        "step_error",
                        "overhead",
                        "p2p",
                        "p2p_backward",
                    )
                },
                # How close the traced steps came to the compute bound of their schedule.
                "traced/bound": statistics.median(
                    c.traced_step / replay(ex.schedule, spans, free_transfers=True).step_time
                    for c, spans in zip(checks, traced, strict=True)
                ),
                "exposed": statistics.median(
                    exposed(ex.schedule, spans, events) for spans, events in zip(traced, comms, strict=True)
                ),
                "hidden": [sum(n) for n in zip(*(hidden_receives(events) for events in comms), strict=True)],
                "spans": traced[-1],
                "comms": comms[-1],
            }
        for cls_name in theirs_names:
            out[cls_name] = (statistics.median(times[cls_name]), min(times[cls_name]), memory[cls_name])
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


PAIRS_OFF = "dualpipe_v, pairs off"
"""dualpipe_v on an MoE with each compute run alone: every expert all-to-all synchronous."""


def _moe_worker(rank: int, world: int, store: str, args: argparse.Namespace, results: dict) -> None:
    """dualpipe_v on a small Mixtral at pp x ep with its overlapped pairs and without: timed steps, then
    traced ones, each process's all-to-alls against its own computes (``collective_overlap``)."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    topo = Topology(ParallelConfig(pp=args.pp, ep=args.ep, virtual_stages=2), world, rank)
    cfg = ModelConfig(
        arch="mixtral",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        num_kv_heads=args.hidden // 128 or 1,
        vocab_size=args.vocab,
        seq_length=args.seq,
        num_experts=args.experts,
        kernels="torch",
    )
    m, b = args.microbatches, args.micro_batch_size
    # Each data-parallel (here: expert-parallel) rank its own micro-batches, as in training.
    gen = torch.Generator().manual_seed(topo.dp_rank)
    micro = list(torch.randint(0, cfg.vocab_size, (m * b, cfg.seq_length + 1), generator=gen).split(b))
    shape = activation_shape(b, cfg.seq_length, cfg.hidden_size)

    def fresh() -> PipelineExecutor:
        torch.manual_seed(1234)
        model = apply_ep(build(cfg), topo)
        stages = build_stages(model, topo, 2, head_cost=head_cost_in_layers(cfg), v_shape=True)
        return PipelineExecutor(stages, build_schedule("dualpipe_v", args.pp, m, 2), topo, shape)

    executors = {"dualpipe_v": fresh(), PAIRS_OFF: fresh()}
    executors[PAIRS_OFF].overlap = False
    assert executors["dualpipe_v"].overlap, "dualpipe_v runs no overlapped pairs on this layout"
    runs = {name: (ex.stages, lambda ex=ex: ex.run(micro)) for name, ex in executors.items()}
    times = _rotated_times(runs, args.warmup, args.steps)
    out: dict[str, object] = {}
    for name, ex in executors.items():
        figures, p2p = [], []
        for _ in range(args.traced_steps):
            _traced_step(ex, micro)
            spans = [Span(**e) for e in ex.trace]
            collectives = [CommEvent(**e) for e in ex.collective_trace]
            mine = (*collective_overlap(spans, collectives), len(nested_collectives(spans, collectives)))
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            figures.append([sum(column) for column in zip(*gathered, strict=True)])
            # Pipeline transfers: exposed as the dense table counts them, per pipeline (its ranks' spans).
            pipeline: list = [None] * args.pp
            traces = (ex.trace, ex.comm_trace, ex.collective_trace)
            dist.all_gather_object(pipeline, traces, group=topo.pp_group)
            p2p.append(
                exposed(
                    ex.schedule,
                    [Span(**e) for trace, _, _ in pipeline for e in trace],
                    [CommEvent(**e) for _, comms, _ in pipeline for e in comms],
                )
            )
        pipelines: list = [None] * world
        dist.all_gather_object(pipelines, statistics.median(p2p))
        out[name] = {
            "time": statistics.median(times[name]),
            "best": min(times[name]),
            "exposed": statistics.median(f[0] for f in figures),
            "hidden": statistics.median(f[1] for f in figures),
            "nested": statistics.median(f[2] for f in figures),
            # Each pipeline's figure once (its pp ranks gathered the same).
            "p2p": sum(pipelines[topo.rank_of(pp_rank=0, dp_rank=d)] for d in range(topo.dp)),
            # The last traced step of the pipeline of data-parallel rank 0, for the picture.
            "pipeline": pipeline if topo.dp_rank == 0 else None,
        }
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def _print_moe(args: argparse.Namespace, r: dict) -> None:
    """The table of dualpipe_v's expert all-to-alls with its overlapped pairs and without."""
    print(
        f"dualpipe_v on mixtral: pp={args.pp} ep={args.ep} ({args.pp * args.ep} gloo processes, CPU) "
        f"microbatches={args.microbatches} micro_batch_size={args.micro_batch_size} layers={args.layers} "
        f"hidden={args.hidden} experts={args.experts} seq={args.seq} threads/rank={args.threads}"
    )
    print(
        "\nexpert all-to-alls: exposed = seconds a process had one in flight (issued to its wait's return)"
        " while none of its computes ran, hidden = seconds one was in flight inside a compute interval; per"
        " step, summed over processes, median of the traced steps; nested = all-to-alls of one micro-batch"
        " issued before and returned after a compute interval of another; p2p exposed as in the dense table"
    )
    print(
        f"{'schedule':<24}{'median s':>9}{'best s':>8}{'a2a exposed s':>14}{'a2a hidden s':>13}"
        f"{'nested':>7}{'p2p exposed s':>14}"
    )
    for name in ("dualpipe_v", PAIRS_OFF):
        row = r[name]
        print(
            f"{name:<24}{row['time']:9.4f}{row['best']:8.4f}{row['exposed']:14.4f}{row['hidden']:13.4f}"
            f"{row['nested']:7.0f}{row['p2p']:14.4f}"
        )
    on, off = r["dualpipe_v"], r[PAIRS_OFF]
    ratio, best = on["time"] / off["time"], on["best"] / off["best"]
    print(f"step time, pairs on / off: median {ratio:.3f}, best {best:.3f}")


def _draw_moe(args: argparse.Namespace, r: dict) -> None:
    """One overlapped pair of the traced step of one pipeline (of rank 0's pairs whose all-to-alls nest in
    the other micro-batch's compute, the one that computed the largest share of its time), both ranks over its
    time: each compute's computing
    intervals, its all-to-alls red from issue to return."""
    pipeline = r["dualpipe_v"]["pipeline"]
    spans = [Span(**e) for trace, _, _ in pipeline for e in trace]
    collectives = [CommEvent(**e) for _, _, trace in pipeline for e in trace]
    mine = [s for s in spans if s.rank == 0], [c for c in collectives if c.rank == 0]
    busy = computing(*mine)

    def window(exchange: CommEvent) -> tuple[float, float, float]:
        """(share of the window rank 0 computed, start, end) of the pair ``exchange`` ran in."""
        pair = [s for s in mine[0] if s.start < exchange.done and exchange.posted < s.end]
        t0, t1 = min(s.start for s in pair), max(s.end for s in pair)
        inside = sum(max(0.0, min(p.end, t1) - max(p.start, t0)) for p in busy)
        return inside / (t1 - t0), t0, t1

    # The pair least disturbed by the machine's load: the largest share of its time computing.
    _, t0, t1 = max(window(exchange) for exchange, _ in nested_collectives(*mine))
    pieces = [
        replace(p, start=max(p.start, t0), end=min(p.end, t1))
        for rank in range(args.pp)
        for p in computing([s for s in spans if s.rank == rank], [c for c in collectives if c.rank == rank])
        if p.end > t0 and p.start < t1
    ]
    names = ", ".join(sorted({f"{s.kind}{s.microbatch}" for s in mine[0] if t0 <= s.start and s.end <= t1}))
    title = (
        f"dualpipe_v on mixtral, pp={args.pp} ep={args.ep} m={args.microbatches} (traced, gloo): rank 0's"
        f" pair {names}\nexpert all-to-alls issued to returned (red) under the other micro-batch's compute"
    )
    render_png(
        pieces,
        args.overlap_timeline,
        title,
        "seconds",
        transfers=[
            (c.rank, max(c.posted, t0), min(c.done, t1)) for c in collectives if c.done > t0 and c.posted < t1
        ],
        transfer_label="expert all-to-all in flight",
    )
    print(f"wrote {args.overlap_timeline}")


def _print_overlap(r: dict) -> None:
    """The table of dualpipe_v's exposed communication with and without its transfers posted ahead."""
    print(
        "\ndualpipe_v transfers: posted asynchronously ahead of the computes that need them (as run) against"
        " posted only when needed (lookahead 0); exposed = seconds ranks waited for received data after its"
        " producer had computed it, per step (summed over ranks, median of the traced steps); hidden ="
        " receives complete before their compute needed them (all traced steps)"
    )
    print(f"{'schedule':<24}{'median s':>9}{'exposed s':>10}{'hidden':>12}")
    for name in ("dualpipe_v", NO_OVERLAP):
        row = r[name]
        inside, total = row["hidden"]
        print(f"{name:<24}{row['time']:9.4f}{row['exposed']:10.4f}{f'{inside}/{total}':>12}")


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
    parser.add_argument(
        "--v-only",
        action="store_true",
        help="only interleaved_zb, zb_v and dualpipe_v against torch's schedules of the same order (minutes)",
    )
    parser.add_argument(
        "--moe", action="store_true", help="dualpipe_v on a small Mixtral, overlapped pairs on against off"
    )
    parser.add_argument("--ep", type=int, default=2, help="--moe: expert-parallel ranks (pp x ep processes)")
    parser.add_argument("--experts", type=int, default=4, help="--moe: experts per layer")
    parser.add_argument("--timeline", help="PNG of the traced interleaved run")
    parser.add_argument(
        "--overlap-timeline", help="PNG of the traced dualpipe_v run with its receives in flight (red)"
    )
    parser.add_argument(
        "--trace-out", help="trace JSON of the interleaved run (for tools/show_schedule.py --trace)"
    )
    args = parser.parse_args(argv)
    if (args.v_only or args.moe) and (args.timeline or args.trace_out):
        parser.error("--timeline and --trace-out draw interleaved_1f1b, which --v-only and --moe do not run")
    if args.moe and args.v_only:
        parser.error("--moe runs dualpipe_v only; drop --v-only")
    # glibc returns freed blocks above 64 KiB to the kernel at once, so resident memory follows live tensors.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    world = args.pp * args.ep if args.moe else args.pp
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            _moe_worker if args.moe else _worker,
            args=(world, os.path.join(tmp, "store"), args, results),
            nprocs=world,
            join=True,
        )
        r = dict(results)
    if args.moe:
        _print_moe(args, r)
        if args.overlap_timeline:
            _draw_moe(args, r)
        return
    print(
        f"pp={args.pp} microbatches={args.microbatches} micro_batch_size={args.micro_batch_size} "
        f"layers={args.layers} hidden={args.hidden} seq={args.seq} threads/rank={args.threads} (gloo, CPU)"
    )
    mib = 2**20
    print(
        "\nstep time (median and best of the timed steps) and peak memory per rank (resident memory above the"
        " step's start, MiB; the fullest rank); ratios are ours over torch's, memory's the largest per-rank"
        " ratio"
    )
    print(
        f"{'schedule':<24}{'median s':>9}{'best s':>8}{'torch med':>10}{'torch best':>11}{'ratio med':>10}"
        f"{'ratio best':>11}{'peak MiB':>9}{'torch MiB':>10}{'mem ratio':>10}"
    )
    rows = [(name, torch_key) for name, torch_key in ROWS if name in r]
    for name, torch_key in rows:
        row = r[name]
        line = f"{name:<24}{row['time']:9.4f}{row['best']:8.4f}"
        if torch_key:
            med, best, mem = r[torch_key]
            ratio = max(ours / theirs for ours, theirs in zip(row["memory"], mem, strict=True))
            line += f"{med:10.4f}{best:11.4f}{row['time'] / med:10.3f}{row['best'] / best:11.3f}"
            line += f"{max(row['memory']) / mib:9.1f}{max(mem) / mib:10.1f}{ratio:10.3f}"
        else:
            line += " " * 42 + f"{max(row['memory']) / mib:9.1f}"
        print(line)
    print(
        f"\nbubble: measured (the traced step) against simulated (the simulator replaying that step's own"
        f" per-action durations, host overhead and transfer latency); within {TOLERANCE:.0%} means"
        " |measured - simulated| / simulated; step error is the same for the step times"
    )
    print(
        f"{'schedule':<24}{'measured':>9}{'simulated':>10}{'rel. error':>11}{'within':>7}{'step error':>11}"
        f"{'overhead ms':>12}{'p2p F ms':>9}{'p2p B ms':>9}{'traced/bound':>13}"
    )
    for name, _ in rows:
        row = r[name]
        print(
            f"{name:<24}{row['measured']:9.3f}{row['simulated']:10.3f}{row['relative_error']:11.3f}"
            f"{'yes' if row['relative_error'] <= TOLERANCE else 'no':>7}{row['step_error']:11.3f}"
            f"{1e3 * row['overhead']:12.2f}{1e3 * row['p2p']:9.2f}{1e3 * row['p2p_backward']:9.2f}"
            f"{row['traced/bound']:13.3f}"
        )
    if NO_OVERLAP in r:
        _print_overlap(r)
    if args.timeline:
        spans = r["interleaved_1f1b"]["spans"]
        title = (
            f"interleaved_1f1b pp={args.pp} m={args.microbatches} v=2 (traced, gloo)  bubble "
            f"{r['interleaved_1f1b']['measured']:.1%}, simulated {r['interleaved_1f1b']['simulated']:.1%}"
        )
        render_png(spans, args.timeline, title, "seconds")
        print(f"wrote {args.timeline}")
    if args.overlap_timeline:
        row = r["dualpipe_v"]
        receives = in_flight(
            build_schedule("dualpipe_v", args.pp, args.microbatches, 2), row["spans"], row["comms"]
        )
        inside, total = row["hidden"]
        title = (
            f"dualpipe_v pp={args.pp} m={args.microbatches} (traced); receives in flight, posted to done:"
            f" {inside}/{total} there before needed"
        )
        render_png(row["spans"], args.overlap_timeline, title, "seconds", transfers=receives)
        print(f"wrote {args.overlap_timeline}")
    if args.trace_out:
        save_trace(r["interleaved_1f1b"]["spans"], args.trace_out)
        print(f"wrote {args.trace_out}")


if __name__ == "__main__":
    main()
