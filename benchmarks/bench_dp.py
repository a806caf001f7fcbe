"""Data-parallel step time and memory: ours (zero_stage 0-3) vs torch DDP, plain FSDP2 (fully_shard with
torch's AdamW, as ZeRO-2 and ZeRO-3) and DeepSpeed ZeRO-1/2/3 (and ZeRO-2/3 with CPU offload, as
parallel.engine=deepspeed configures them).

Every variant trains the same model (same weights, fp32) on the same per-rank batch with AdamW and
global-norm clipping at 1.0, on the same gloo process group, in the same run. Variants take turns
(round-robin, a few consecutive steps each per round, over many rounds) so load from other processes hits
them alike; a variant's step time is its turn's time over its step count, median over rounds, and the
minimum (its least disturbed turn) is shown beside it. A step is zero_grad + forward + backward (with the
DP reduction) + clip + AdamW; a turn ends once no communication of the variant is in flight (our ZeRO-1
and ZeRO-2 overlap their parameter all-gathers with the next step's forward, so a turn waits for the last
one); its time is the slowest rank's. Optimizer bytes are what each rank holds beyond the model: Adam
states plus any separate fp32 copy.

Peak memory per rank is measured per variant while it is built and takes its warm-up steps, before any
timing: the bytes of live tensors the variant created (PyTorch's MemTracker, llmtrain.training.
memory_tracking) on CPU, the CUDA allocator's peak above the level before the variant on GPU; the highest
rank's. "startup" covers building (every variant here starts from the same whole fp32 model, so ZeRO-3's
startup is not its sharded construction; benchmarks/bench_memory.py measures that), "step" the training
steps: parameters, gradients, optimizer state, activations and gathered buffers.

  python benchmarks/bench_dp.py                          # 2 processes, gpt 4x256, seq 128, batch 4 per rank
  DS_ACCELERATOR=cpu python benchmarks/bench_dp.py --nproc 4 --hidden 512
  python benchmarks/bench_dp.py --only "ours zero2" "DeepSpeed ZeRO-2"   # a subset, same protocol
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from llmtrain import models  # noqa: E402
from llmtrain.config import JobConfig, ModelConfig  # noqa: E402
from llmtrain.parallel import Topology, build_optimizer, parallelize  # noqa: E402
from llmtrain.parallel.fsdp import wait_gathers  # noqa: E402
from llmtrain.parallel.optimizer import no_weight_decay  # noqa: E402
from llmtrain.training.memory_tracking import PeakMemory  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags: process count, model size, batch and measurement counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--arch", default="gpt")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before measuring")
    p.add_argument("--rounds", type=int, default=15, help="timed turns per variant, interleaved")
    p.add_argument("--steps-per-turn", type=int, default=3, help="consecutive steps in one timed turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="our parallel.dp_bucket_mb (default: the config's)"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when it is installed")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help='measure only these variants (as printed, e.g. "ours zero2" "DeepSpeed ZeRO-2")',
    )
    return p.parse_args(argv)


def _job(args: argparse.Namespace, zero: int, world: int) -> JobConfig:
    job = JobConfig(
        model=ModelConfig(
            arch=args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            vocab_size=args.vocab,
            seq_length=args.seq,
            kernels="torch",
        )
    )
    job.parallel.zero_stage = zero
    if args.bucket_mb is not None:
        job.parallel.dp_bucket_mb = args.bucket_mb
    job.train.micro_batch_size = args.batch
    job.train.global_batch_size = args.batch * world
    return job


def _fresh_model(job: JobConfig) -> nn.Module:
    torch.manual_seed(job.train.seed)
    return models.build(job.model)


def _adamw_groups(model: nn.Module, wd: float) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": wd},
        {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0},
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _local(v).numel() * _local(v).element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.ndim
    )


Variant = tuple[Callable[[torch.Tensor], None], Callable[[], None], Callable[[], int]]
"""(one training step on a batch, wait for the variant's communication in flight, optimizer bytes)"""


class Result(NamedTuple):
    """One variant's figures; times in seconds, memory in bytes per rank (the highest rank's)."""

    median_s: float
    min_s: float
    optimizer_bytes: int
    startup_peak_bytes: int
    step_peak_bytes: int


def _nothing_in_flight() -> None:
    """DDP and DeepSpeed finish every collective inside their step."""


def _ours(job: JobConfig, topo: Topology) -> Variant:
    model = _fresh_model(job)
    parallelize(model, topo, job)
    opt = build_optimizer(model, topo, job)

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        opt.backward(model(batch[:, :-1], batch[:, 1:]))
        opt.step(job.train.lr)

    # ZeRO-0/1 (and ZeRO-2 on gloo) may still be gathering parameters for the next step.
    settle = model.grad_buffers.wait_params if hasattr(model, "grad_buffers") else lambda: wait_gathers(model)
    return step, settle, opt.state_bytes


def _plain_fsdp2(job: JobConfig, reshard_after_forward: bool) -> Variant:
    """torch's fully_shard on every block and the root, torch's AdamW and clip_grad_norm_ on the sharded
    parameters: FSDP2 as its documentation and torchtitan use it, without llmtrain's wrapper."""
    model = _fresh_model(job)
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return _torch_adamw(model, model, job, fused=False)


def _ddp(job: JobConfig, topo: Topology) -> Variant:
    model = _fresh_model(job)
    return _torch_adamw(nn.parallel.DistributedDataParallel(model), model, job, fused=True)


def _torch_adamw(wrapped: nn.Module, model: nn.Module, job: JobConfig, fused: bool) -> Variant:
    """A step as torch's own users write it: `wrapped` (DDP or the FSDP2 model itself) forward and backward,
    clip_grad_norm_ and torch's AdamW over `model`'s parameters (fused where they are plain tensors)."""
    t = job.train
    opt = torch.optim.AdamW(
        _adamw_groups(model, t.weight_decay),
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        fused=fused,
    )

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        wrapped(batch[:, :-1], batch[:, 1:]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()

    return step, _nothing_in_flight, lambda: _state_bytes(opt)


def _deepspeed(job: JobConfig, topo: Topology, stage: int, offload: str) -> Variant:
    """DeepSpeed's ZeRO engine as parallel.engine=deepspeed configures it (llmtrain.parallel.
    deepspeed_engine.deepspeed_config), stepped the way DeepSpeed's users step it."""
    from llmtrain.parallel.deepspeed_engine import build_deepspeed

    job.parallel.engine, job.parallel.zero_stage, job.parallel.offload = "deepspeed", stage, offload
    engine, _ = build_deepspeed(_fresh_model(job), topo, job)
    zero = engine.optimizer

    def step(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()

    def state_bytes() -> int:
        # The fp32 master partitions (stages 1-2 / stage 3) and Adam's states, wherever they live.
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        return _state_bytes(zero.optimizer) + sum(p.numel() * p.element_size() for p in masters)

    return step, _nothing_in_flight, state_bytes


# (name, zero stage, parallel.offload) of the DeepSpeed peers.
DEEPSPEED_VARIANTS = [
    ("DeepSpeed ZeRO-1", 1, "none"),
    ("DeepSpeed ZeRO-2", 2, "none"),
    ("DeepSpeed ZeRO-3", 3, "none"),
    ("DeepSpeed ZeRO-2 offload", 2, "optimizer"),
    ("DeepSpeed ZeRO-3 offload", 3, "optimizer+params"),
]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    builders: dict[str, Callable[[], Variant]] = {}
    for zero in (0, 1, 2, 3):
        job = _job(args, zero, world)
        builders[f"ours zero{zero}"] = lambda job=job: _ours(job, Topology(job.parallel, world, rank))
    builders["torch DDP"] = lambda: _ddp(_job(args, 0, world), None)
    builders["FSDP2 (as ZeRO-2)"] = lambda: _plain_fsdp2(_job(args, 0, world), reshard_after_forward=False)
    builders["FSDP2 (as ZeRO-3)"] = lambda: _plain_fsdp2(_job(args, 0, world), reshard_after_forward=True)
    if not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None:
        for name, stage, offload in DEEPSPEED_VARIANTS:
            job = _job(args, 0, world)
            builders[name] = lambda job=job, stage=stage, offload=offload: _deepspeed(
                job, Topology(job.parallel, world, rank), stage, offload
            )
    if args.only:
        builders = {name: build for name, build in builders.items() if name in args.only}
    g = torch.Generator().manual_seed(1000 + rank)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    variants: dict[str, Variant] = {}
    peaks: dict[str, tuple[int, int]] = {}
    for name, build in builders.items():
        variants[name], peaks[name] = _built_and_warmed(build, batch, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (step, settle, _) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_turn):
                step(batch)
            settle()
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps_per_turn])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    memory = {
        name: torch.tensor([float(state()), *map(float, peaks[name])])
        for name, (_, _, state) in variants.items()
    }
    for v in memory.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.update(
            {
                name: Result(
                    statistics.median(times[name]), min(times[name]), *(int(x) for x in memory[name].tolist())
                )
                for name in variants
            }
        )
    dist.destroy_process_group()


def _built_and_warmed(
    build: Callable[[], Variant], batch: torch.Tensor, warmup: int
) -> tuple[Variant, tuple[int, int]]:
    """The variant after its untimed warm-up steps, and this rank's (startup, step) peak bytes: what the
    variant itself allocated (see the module docstring)."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = PeakMemory(device, track_cpu_tensors=True)
    with peak.tracking():
        variant = build()
        peak.end_startup()
        step, settle, _ = variant
        for _ in range(warmup):
            step(batch)
        settle()
    return variant, (peak.startup_bytes - before, peak.peak_bytes() - before)


def main(argv: list[str] | None = None) -> dict[str, Result]:
    """Run the benchmark; print step times, memory per rank and the ratios of ours to each peer."""
    args = parse_args(argv)
    names = [f"ours zero{z}" for z in range(4)] + ["torch DDP", "FSDP2 (as ZeRO-2)", "FSDP2 (as ZeRO-3)"]
    unknown = set(args.only or []) - set(names) - {name for name, _, _ in DEEPSPEED_VARIANTS}
    if unknown:
        raise SystemExit(f"--only: no variant named {sorted(unknown)}; the variants: {names}, DeepSpeed's")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, join=True)
        result: dict[str, Result] = dict(out)
    params = sum(p.numel() for p in _fresh_model(_job(args, 0, 1)).parameters())
    print(
        f"{args.nproc} processes (gloo, {args.threads} thread each), {args.arch} {args.layers}x{args.hidden} "
        f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}/rank, fp32, {params / 1e6:.2f}M params, "
        f"{args.rounds} interleaved turns of {args.steps_per_turn} steps each"
    )
    mib = 2**20
    print(
        f"{'variant':<26} {'median ms':>10} {'min ms':>8} {'opt MiB':>9} {'startup MiB':>12} {'step MiB':>9}"
        "   (per rank)"
    )
    for name, r in result.items():
        print(
            f"{name:<26} {r.median_s * 1e3:>10.1f} {r.min_s * 1e3:>8.1f} {r.optimizer_bytes / mib:>9.2f} "
            f"{r.startup_peak_bytes / mib:>12.2f} {r.step_peak_bytes / mib:>9.2f}"
        )
    # Each of ours against the peers doing the same job (the same ZeRO stage, or DDP for plain DP).
    same_job = {
        "ours zero0": ["torch DDP"],
        "ours zero1": ["DeepSpeed ZeRO-1"],
        "ours zero2": ["DeepSpeed ZeRO-2", "FSDP2 (as ZeRO-2)"],
        "ours zero3": ["DeepSpeed ZeRO-3", "FSDP2 (as ZeRO-3)"],
    }
    for ours, peers in same_job.items():
        for other in (p for p in peers if p in result):
            a, b = result[ours], result[other]
            print(
                f"{ours} / {other}: step time {a.median_s / b.median_s:.3f} (median), "
                f"{a.min_s / b.min_s:.3f} (min); "
                f"step peak memory {a.step_peak_bytes / b.step_peak_bytes:.3f}; "
                f"optimizer bytes {a.optimizer_bytes / b.optimizer_bytes:.3f}"
            )
    if not any(name.startswith("DeepSpeed") for name in result):
        print("DeepSpeed: not measured (not installed or --no-deepspeed)")
    return result


if __name__ == "__main__":
    main()
