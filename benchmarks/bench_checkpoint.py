"""Checkpoint throughput and the time training is blocked by a save, against the references, same run.

Same state everywhere: an llmtrain model after one optimizer step (weights + AdamW moments; fp32 masters
too with --precision bf16), one process.
  save GB/s: Checkpointer.save (sync: DCP + manifest + CRC-32 + atomic publish) vs torch.save of
             model.state_dict() + optimizer.state_dict() (then fsync, as DCP does) vs a bare
             torch.distributed.checkpoint.save of the same two state dicts.
  load GB/s: Checkpointer.load (verifies every CRC-32 first) vs torch.load (+ load_state_dict) vs a bare
             dcp.load. The files are in the page cache right after the save, for every contender alike.
  blocked:   extra wall time of training steps that overlap a save: sync = the save itself; async = the
             snapshot copy plus the slowdown of the steps that run while the background thread writes.
Timings are the fastest of --repeats interleaved rounds (fair under drifting load on a shared machine).

    python benchmarks/bench_checkpoint.py [--hidden 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from llmtrain import models
from llmtrain.checkpoint import Checkpointer
from llmtrain.config import JobConfig, ModelConfig
from llmtrain.parallel import Topology, build_optimizer, parallelize

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _job(args: argparse.Namespace, out: Path, async_save: bool) -> JobConfig:
    job = JobConfig(
        model=ModelConfig(
            arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
            vocab_size=args.vocab, seq_length=64, kernels="torch",
        ),
        output_dir=str(out),
    )  # fmt: skip
    job.train.precision = args.precision
    job.checkpoint.async_save = async_save
    job.checkpoint.keep = 1
    return job


def _setup(job: JobConfig, args: argparse.Namespace) -> tuple:
    topo = Topology.single()
    torch.manual_seed(0)
    model = models.build(job.model)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    parallelize(model, topo, job)
    opt = build_optimizer(model, topo, job)
    ids = torch.randint(0, args.vocab, (2, 65))

    def step() -> None:
        opt.zero_grad()
        opt.backward(model(ids[:, :-1], ids[:, 1:]))
        opt.step(1e-4)

    step()  # creates the AdamW moments
    return topo, model, opt, step


def _state_bytes(model: torch.nn.Module, opt: object) -> int:
    tensors = list(model.state_dict().values())
    tensors += [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if opt.master_flat is not None:
        tensors.append(opt.master_flat)
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fsync_tree(path: Path) -> None:
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file():
            with open(f, "rb+") as handle:
                os.fsync(handle.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="training steps overlapping each save")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # leave the other core to the background writer, as a trainer would on GPU

    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench_checkpoint_"))
    try:
        job = _job(args, root / "ours", async_save=False)
        topo, model, opt, step = _setup(job, args)
        sync_ck = Checkpointer(job, topo)
        async_ck = Checkpointer(_job(args, root / "ours_async", async_save=True), topo)
        nbytes = _state_bytes(model, opt)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rounds = args.repeats
        print(f"state: {nbytes / 2**20:.1f} MiB ({params:.1f} M params, {args.precision}), best of {rounds}")

        torch_file = root / "torch.pt"
        dcp_dir = root / "dcp"

        def torch_save() -> None:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, torch_file)
            _fsync_tree(torch_file)

        def torch_load() -> None:
            state = torch.load(torch_file, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])

        def dcp_save() -> None:
            shutil.rmtree(dcp_dir, ignore_errors=True)
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(dcp_dir))

        def dcp_load() -> None:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=str(dcp_dir))
            opt.load_state_dict(state["optim"])

        counter = iter(range(1, 1 << 30))

        def ours_save() -> None:
            sync_ck.save(next(counter), model, opt, {"step": 0})

        def ours_load() -> None:
            sync_ck.load(sync_ck.resume_path(), model, opt)

        def steps_alone() -> None:
            for _ in range(args.steps):
                step()

        def steps_with(ck: Checkpointer) -> None:
            ck.save(next(counter), model, opt, {"step": 0})
            for _ in range(args.steps):
                step()
            ck.wait()  # a save still running after the steps blocks the next one: count it

        names = ["torch_save", "dcp_save", "ours_save", "torch_load", "dcp_load", "ours_load", "steps",
                 "steps_sync", "steps_async"]  # fmt: skip
        fns = [torch_save, dcp_save, ours_save, torch_load, dcp_load, ours_load, steps_alone,
               lambda: steps_with(sync_ck), lambda: steps_with(async_ck)]  # fmt: skip
        best = {n: float("inf") for n in names}
        for _ in range(args.repeats):
            for name, fn in zip(names, fns, strict=True):
                best[name] = min(best[name], _timed(fn))
        async_ck.close()

        gb = nbytes / 1e9
        rows = [
            ("save  torch.save+fsync", best["torch_save"]),
            ("save  bare DCP", best["dcp_save"]),
            ("save  Checkpointer (sync)", best["ours_save"]),
            ("load  torch.load", best["torch_load"]),
            ("load  bare DCP", best["dcp_load"]),
            ("load  Checkpointer (verified)", best["ours_load"]),
        ]
        for label, t in rows:
            print(f"{label:<32} {t * 1e3:8.1f} ms  {gb / t:6.2f} GB/s")
        blocked_sync = best["steps_sync"] - best["steps"]
        blocked_async = best["steps_async"] - best["steps"]
        print(f"{args.steps} training steps alone: {best['steps'] * 1e3:.1f} ms")
        print(f"blocked by a sync save:  {blocked_sync * 1e3:8.1f} ms")
        print(f"blocked by an async save: {blocked_async * 1e3:8.1f} ms")
        print("ratios (higher is better for us):")
        print(f"  save GB/s  ours/torch.save = {best['torch_save'] / best['ours_save']:.2f}   "
              f"ours/bare DCP = {best['dcp_save'] / best['ours_save']:.2f}")  # fmt: skip
        print(f"  load GB/s  ours/torch.load = {best['torch_load'] / best['ours_load']:.2f}   "
              f"ours/bare DCP = {best['dcp_load'] / best['ours_load']:.2f}")  # fmt: skip
        print(f"  blocked    sync/async = {blocked_sync / max(blocked_async, 1e-6):.2f}   "
              f"torch.save/async = {best['torch_save'] / max(blocked_async, 1e-6):.2f}")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
