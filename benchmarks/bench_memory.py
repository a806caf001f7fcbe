"""Predicted against measured per-rank peak memory, for layouts the trainer runs on this machine.

Each row trains a small LLaMA (tools/pretrain.py under torchrun, gloo, logging.memory=true) for a few steps
and reads every rank's measured peaks from metrics.jsonl: the bytes of live tensors tracked by PyTorch's
MemTracker at startup (building and sharding the model) and during the steps (llmtrain.training.
memory_tracking). The planner's memory model (llmtrain.planner.cost.memory, through CostModel) predicts the
fullest rank's peaks for the same config and layout on a device with no reserved memory (a CPU holds no
runtime context among its tensors). The table shows both and their ratio; the target is within 10%.

A row is a set of config overrides: plain, ZeRO-1/2/3, hybrid sharding, TP, PP (each schedule, the trainer's
FLOP-balanced stage split) and DeepSpeed offload layouts.

  python benchmarks/bench_memory.py                 # every row, 2 steps each
  python benchmarks/bench_memory.py --rows dp2-zero1 tp2-sp --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmtrain.config import load
from llmtrain.planner import CostModel, Software, Workload, cluster_from_dict
from llmtrain.planner.cost.layout import layout_of_job

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama-small.yaml"
DEEPSEEK = ROOT / "configs" / "deepseek-v3-small.yaml"
MIXTRAL = ROOT / "configs" / "mixtral-small.yaml"
MIB = 2**20

SHAPE = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "model.seq_length=256",
]
"""The llama rows' model (a config of their own keeps its model)."""
RUN = [
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "train.num_threads=1",
    "train.warmup_steps=1",
    "checkpoint.interval=0",
    "logging.tensorboard=false",
    "logging.interval=1",
    "logging.memory=true",
]


@dataclass(frozen=True)
class Row:
    """One layout: a name, its config overrides and its config (llama-small with SHAPE by default)."""

    name: str
    overrides: tuple[str, ...]
    config: Path | None = None

    @property
    def job_overrides(self) -> list[str]:
        return [*(SHAPE if self.config is None else ()), *RUN, *self.overrides]

    @property
    def world(self) -> int:
        values = dict(o.split("=", 1) for o in self.overrides)
        tp, pp = int(values.get("parallel.tp", 1)), int(values.get("parallel.pp", 1))
        return tp * pp * int(values.get("parallel.dp", 1))


PP = ("parallel.pp=2",)

ROWS = [
    Row("single", ()),
    Row("single-full-rc", ("model.recompute=full",)),
    Row("dp2", ("parallel.dp=2",)),
    Row("dp2-zero1", ("parallel.dp=2", "parallel.zero_stage=1")),
    Row("dp2-zero1-bf16", ("parallel.dp=2", "parallel.zero_stage=1", "train.precision=bf16")),
    Row("tp2", ("parallel.tp=2",)),
    Row(
        "tp2-sp-selective", ("parallel.tp=2", "parallel.sequence_parallel=true", "model.recompute=selective")
    ),
    Row("pp2-1f1b", (*PP, "train.micro_batch_size=2")),
    Row(
        "pp2-interleaved",
        (
            *PP,
            "parallel.schedule=interleaved_1f1b",
            "parallel.virtual_stages=2",
            "train.micro_batch_size=2",
        ),
    ),
    Row(
        "pp2-zb_h1-full-rc",
        (*PP, "parallel.schedule=zb_h1", "model.recompute=full", "train.micro_batch_size=2"),
    ),
    Row("tp2-dp2-zero1", ("parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1")),
    Row("dp2-zero2", ("parallel.dp=2", "parallel.zero_stage=2")),
    Row("dp2-zero3", ("parallel.dp=2", "parallel.zero_stage=3")),
    # The rows above accumulate two micro-batches, each reduce-scattered into the gradient shards; this one
    # keeps them unsharded in fp32 until the step's last (parallel.grad_reduce=step); the next has one.
    Row("dp2-zero3-step", ("parallel.dp=2", "parallel.zero_stage=3", "parallel.grad_reduce=step")),
    Row("dp2-zero2-1micro", ("parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch_size=8")),
    Row("dp4-zero3-hsdp2", ("parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2")),
    Row("tp2-dp2-zero3", ("parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=3")),
    Row("pp2-dp2-zero3", (*PP, "parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=2")),
    Row(
        "dp2-zero2-offload",
        ("parallel.dp=2", "parallel.zero_stage=2", "parallel.engine=deepspeed", "parallel.offload=optimizer"),
    ),
    # DeepSeek-V3-small under TP: latent attention's down-projections and the MoE layers' weights whole on
    # every TP rank, the up-projections, o_proj and the dense MLP split.
    Row("deepseek-tp2-sp", ("parallel.tp=2", "parallel.sequence_parallel=true"), DEEPSEEK),
    # Mixtral-small with EP spanning the TP pair (each TP rank 4 of the 8 experts), and EP inside dp at
    # tp=2 under ZeRO-3 (the experts sharded over their expert-DP group, the TP pair).
    Row("mixtral-tp2-ep2-sp", ("parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"), MIXTRAL),
    Row(
        "mixtral-tp2-dp2-ep2-zero3",
        ("parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=3"),
        MIXTRAL,
    ),
]

# This machine as the planner sees it: only the memory fields matter here; no memory is reserved.
CPU_CLUSTER = {
    "name": "this-cpu",
    "devices": {
        "cpu": {"peak_tflops": {"fp32": 1.0, "bf16": 1.0}, "memory_gb": 24, "memory_bandwidth_gbs": 20,
                "reserved_gb": 0.0},
    },
    "nodes": [{"count": 1, "devices_per_node": 8, "device": "cpu", "intra_link": "intra_node"}],
    "links": {"intra_node": {"bandwidth_gbs": 5, "latency_us": 20},
              "inter_node": {"bandwidth_gbs": 5, "latency_us": 20}},
}  # fmt: skip


def predict(config: Path, overrides: list[str], world: int) -> dict[str, float]:
    """The memory model's fullest-rank bytes for the job the row trains."""
    job = load(config, overrides)
    view = cluster_from_dict(CPU_CLUSTER).view(world)
    # On CPU the model's kernels are PyTorch's reference ops, and ZeRO-1 exchanges shards over gloo.
    software = Software(
        fused_kernels=False,
        gloo_shard_exchange=True,
        p2p_held_until_step_end=True,
        balance_stages=job.parallel.balance_stages,
    )
    model = CostModel(Workload.from_job(job), view, software)
    memory = dict(model.evaluate(layout_of_job(job, world)).memory)
    # On a CPU the "host" that offload moves state to is the same memory the tracker counts.
    memory["steady"] += memory["host"]
    return memory


def measure(config: Path, overrides: list[str], world: int, steps: int, workdir: Path) -> dict[str, float]:
    """Train the row's job; every rank's peaks (bytes) from the last metrics.jsonl row."""
    out = workdir / "run"
    args = [str(ROOT / "tools" / "pretrain.py"), "--config", str(config), *overrides, f"train.steps={steps}"]
    args.append(f"output_dir={out}")
    if world == 1:
        command = [sys.executable, *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "rank_peak_memory_gb" in r][-1]
    return {
        "steady": max(last["rank_peak_memory_gb"]) * 2**30,
        "startup": max(last["rank_startup_memory_gb"]) * 2**30,
        "ranks": [round(g * 1024, 1) for g in last["rank_peak_memory_gb"]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", nargs="*", help=f"rows to run (default all: {', '.join(r.name for r in ROWS)})"
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="optimizer steps per row (the peak settles at 2)"
    )
    parser.add_argument("--breakdown", action="store_true", help="also print the predicted parts per row")
    args = parser.parse_args(argv)
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    print(
        f"predicted (planner memory model) vs measured (live tensors, max over ranks) peak per rank, MiB; "
        f"llama {' '.join(SHAPE)} unless a row names its config"
    )
    header = f"{'layout':<20}{'ranks':>6}{'pred step':>11}{'meas step':>11}{'ratio':>7}"
    header += f"{'pred start':>12}{'meas start':>12}{'ratio':>7}  per-rank step peaks"
    print(header)
    worst = 0.0
    for row in rows:
        config, overrides = row.config or CONFIG, row.job_overrides
        predicted = predict(config, overrides, row.world)
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure(config, overrides, row.world, args.steps, Path(tmp))
        step_ratio = predicted["steady"] / measured["steady"]
        start_ratio = predicted["startup"] / measured["startup"]
        worst = max(worst, abs(step_ratio - 1), abs(start_ratio - 1))
        print(
            f"{row.name:<20}{row.world:>6}{predicted['steady'] / MIB:>11.1f}{measured['steady'] / MIB:>11.1f}"
            f"{step_ratio:>7.3f}{predicted['startup'] / MIB:>12.1f}{measured['startup'] / MIB:>12.1f}"
            f"{start_ratio:>7.3f}  {measured['ranks']}",
            flush=True,
        )
        if args.breakdown:
            parts = ("params", "grads", "optimizer", "activations", "gathered", "buffers")
            print("    predicted: " + ", ".join(f"{k} {predicted[k] / MIB:.1f}" for k in parts))
    print(f"worst |ratio - 1|: {100 * worst:.1f}% (target 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
