"""Optimizer step time, state bytes per rank and Muon's extra communication: torch.optim.AdamW,
torch.optim.Muon (with AdamW on the rest) and ours (train.optimizer=adamw / muon) at dp=1 and dp=4 (gloo).

One small LLaMA (fp32) per variant, one forward and backward to fill the gradients, then the optimizer step
alone is timed: ours ``apply`` (clip, update, publish; ZeRO-1's parameter gather waited for, so a step ends
with whole parameters), torch's ``step``; median of --reps steps, the slowest rank's. torch's optimizers are
not sharded: at dp=4 every rank runs the whole update, as under DistributedDataParallel. State bytes are the
optimizer's tensors on a rank (AdamW's two moments, Muon's one momentum buffer; ours adds nothing in fp32).
Extra communication is Muon's per step on a rank: the all-reduce of the stage's whole matrices in fp32
(llmtrain.parallel.muon), counted as a ring's send-and-receive bytes.

  python benchmarks/bench_optimizer.py                 # dp=1 and dp=4, hidden 128, 2 layers
  python benchmarks/bench_optimizer.py --dp 1 --hidden 256 --reps 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig
from llmtrain.parallel import Topology, build_optimizer, parallelize
from llmtrain.parallel.fsdp import wait_gathers
from llmtrain.parallel.muon import muon_updates
from llmtrain.parallel.optimizer import no_weight_decay

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags: data-parallel sizes, model size and repetitions."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 4])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args(argv)


def _job(args: argparse.Namespace, optimizer: str, zero: int, dp: int) -> JobConfig:
    job = JobConfig(
        model=ModelConfig(
            arch="llama",
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=8,
            vocab_size=2048,
            seq_length=64,
            kernels="torch",
        )
    )
    job.train.optimizer = optimizer  # type: ignore[assignment]
    job.parallel.dp, job.parallel.zero_stage = dp, zero
    return job


def _torch_optimizers(model: torch.nn.Module, job: JobConfig, muon: bool) -> list[torch.optim.Optimizer]:
    t = job.train
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    matrices = [p for n, p in named.items() if muon and muon_updates(n, p.shape)]
    taken = {id(p) for p in matrices}
    rest = {n: p for n, p in named.items() if id(p) not in taken}
    groups = [
        {"params": [p for n, p in rest.items() if not no_weight_decay(n, p)], "weight_decay": t.weight_decay},
        {"params": [p for n, p in rest.items() if no_weight_decay(n, p)], "weight_decay": 0.0},
    ]
    out: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, fused=True)
    ]
    if matrices:
        out.append(
            torch.optim.Muon(matrices, lr=t.lr, weight_decay=t.weight_decay, adjust_lr_fn="match_rms_adamw")
        )
    return out


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _state_bytes(opts: list[torch.optim.Optimizer]) -> int:
    return sum(
        v.numel() * v.element_size()
        for o in opts
        for s in o.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.ndim
    )


def _variant(args: argparse.Namespace, name: str, rank: int, dp: int) -> tuple[float, float, float]:
    """(median step seconds, state bytes on the fullest rank, extra communication bytes per step)."""
    kind, _, rest = name.partition(" ")
    optimizer = "muon" if "Muon" in rest or "muon" in rest else "adamw"
    zero = int(rest.rsplit("zero", 1)[1]) if "zero" in rest else 0
    job = _job(args, optimizer, zero, dp)
    batch = torch.randint(
        0, job.model.vocab_size, (4, job.model.seq_length + 1), generator=torch.Generator().manual_seed(rank)
    )
    times = []
    if kind == "torch":
        torch.manual_seed(job.train.seed)
        model = models.build(job.model)
        opts = _torch_optimizers(model, job, optimizer == "muon")
        model(batch[:, :-1], batch[:, 1:]).backward()
        for _ in range(args.reps + 1):
            dist.barrier()
            start = time.perf_counter()
            for o in opts:
                o.step()
            times.append(_max_over_ranks(time.perf_counter() - start))
        return statistics.median(times[1:]), _max_over_ranks(_state_bytes(opts)), 0.0
    topo = Topology(job.parallel, dp, rank)
    model = parallelize(models.empty_model(job.model, device="meta"), topo, job)
    opt = build_optimizer(model, topo, job)
    opt.zero_grad()
    opt.backward(model(batch[:, :-1], batch[:, 1:]))
    norm = opt.prepare()
    for _ in range(args.reps + 1):
        dist.barrier()
        start = time.perf_counter()
        opt.apply(job.train.lr, norm)
        buffers = getattr(model, "grad_buffers", None)
        if buffers is not None:
            buffers.wait_params()
        else:
            wait_gathers(model)
        times.append(_max_over_ranks(time.perf_counter() - start))
    extra = opt.optimizer.comm_bytes() if hasattr(opt.optimizer, "comm_bytes") else 0
    return statistics.median(times[1:]), _max_over_ranks(opt.state_bytes()), float(extra)


def variants(dp: int) -> list[str]:
    """The variants measured at `dp`: torch's two (replicated at dp > 1), ours at each sharding."""
    ours = (
        ["ours adamw", "ours muon"] if dp == 1 else ["ours adamw zero1", "ours muon zero1", "ours muon zero3"]
    )
    return ["torch AdamW", "torch Muon+AdamW", *ours]


def _worker(rank: int, dp: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=dp, timeout=datetime.timedelta(seconds=120))
    try:
        for name in variants(dp):
            seconds, state, extra = _variant(args, name, rank, dp)
            if rank == 0:
                print(
                    f"| {name} | {dp} | {seconds * 1e3:.2f} | {state / MIB:.2f} | {extra / MIB:.2f} |",
                    flush=True,
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"LLaMA hidden {args.hidden}, {args.layers} layers, fp32, gloo; median of {args.reps} steps")
    print("| variant | dp | step ms | state MiB/rank | extra comm MiB/step/rank |")
    print("|---|---|---|---|---|")
    for dp in args.dp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(dp, port, args), nprocs=dp, join=True)


if __name__ == "__main__":
    main()
