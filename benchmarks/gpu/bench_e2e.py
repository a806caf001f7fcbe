"""End-to-end training throughput on one device: tokens/s, TFLOP/s, MFU and peak memory per variant.

Each variant is a config (configs/llama-1b.yaml, configs/llama-3b.yaml) with overrides from the sweep
(torch.compile of the transformer blocks, model.kernels, precision, model.recompute, micro-batch size). It is
built the way tools/pretrain.py builds a run (models.build -> parallelize -> build_optimizer, flat bf16
buffers with fp32 master weights) and trained for a few optimizer steps on random tokens; the first
`--warmup` steps (compilation, autotuning, allocator) are not timed. MFU is against the device's bf16
dense peak (llmtrain.training.peak: datasheet by device name, else measured), FLOPs from
llmtrain.planner.cost.flops (attention included, recomputation not counted), as the trainer's progress line
computes them.

Each variant runs in its own Python process: a variant that fails (out of memory, a compile error) leaves
its memory and torch.compile caches behind in its process, and the next variant must not inherit them.

The named peer is torchtitan's LLaMA-3 at our configs' dimensions. Its own trainer needs a Hugging Face
tokenizer and dataset the GPU machine (no network) does not have, so a "torchtitan" row trains
torchtitan's model with torchtitan's single-GPU recipe (its parallelize_llama: its activation checkpointing
matching the config's recompute, its per-block torch.compile and compiled loss; its bf16 autocast; torch
AdamW, fused) in this script's loop on the same random tokens (titan_peer.py). It runs, in its own
process, right after our first bf16 row of the same config; the JSON's "vs_torchtitan" is our best bf16
tokens/s over torchtitan's (target >= 1.1). Without torchtitan the row says "not installed"; an import
or version mismatch is the row's "failed: ..." reason.

  python benchmarks/gpu/bench_e2e.py --out e2e.json                         # the default sweep, on a GPU
  python benchmarks/gpu/bench_e2e.py --configs configs/llama-1b.yaml --precision bf16 fp8 --compile blocks
  TRITON_INTERPRET=1 python benchmarks/gpu/bench_e2e.py --dry-run --out /tmp/e2e.json   # tiny, on CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Budget, device_name, peer_version, profile_step, sync, write_json  # noqa: E402
from report import vs_torchtitan  # noqa: E402

from llmtrain import models  # noqa: E402
from llmtrain.config import JobConfig, load  # noqa: E402
from llmtrain.parallel import ModelOptimizer, Topology, build_optimizer, parallelize  # noqa: E402
from llmtrain.planner.cost.flops import model_flops_per_token  # noqa: E402
from llmtrain.training.peak import device_peak  # noqa: E402

# A dry run keeps every code path (config, parallelize, fp8 swap, compile option, optimizer, metrics) at
# shapes the CPU runs in seconds; fp8 needs its GEMM dimensions to be multiples of 16. It uses the PyTorch
# kernels: interpreted Triton takes ~30 s a step here and dynamo cannot trace the interpreter (the kernel
# tests and bench_kernels_peers.py --dry-run cover the Triton kernels on CPU).
DRY_RUN_OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=512",
    "model.seq_length=32",
    "model.kernels=torch",
    "train.micro_batch_size=2",
]


def build_training(
    config: Path, overrides: list[str], compile_mode: str, device: str
) -> tuple[JobConfig, torch.nn.Module, ModelOptimizer]:
    """The job, model and optimizer as tools/pretrain.py assembles them on one device (compile_mode
    'blocks' is the user's train.compile=blocks)."""
    job = load(config, [*overrides, f"train.compile={compile_mode}"])
    torch.manual_seed(job.train.seed)
    with torch.device(device):
        model = parallelize(models.build(job.model), Topology.single(), job)
    return job, model, build_optimizer(model, Topology.single(), job)


def timed_steps(step: Callable[[], torch.Tensor], steps: int, warmup: int, device: str, profile: bool):
    """Run `step` (one optimizer step, returning its loss) `steps` times; (losses, median seconds of the
    steps after `warmup`, the profiler's breakdown of one more step or None)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(steps):
        sync(device)
        start = time.perf_counter()
        loss = step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, sorted(times)[len(times) // 2], profile_step(step, device) if profile else None


def run_variant(
    config: Path,
    overrides: list[str],
    compile_mode: str,
    steps: int,
    warmup: int,
    device: str,
    profile: bool = False,
) -> dict[str, Any]:
    """Train `steps` optimizer steps of one micro-batch each; time the ones after `warmup`."""
    job, model, optimizer = build_training(config, overrides, compile_mode, device)
    batch, seq = job.train.micro_batch_size, job.model.seq_length
    tokens = torch.randint(0, job.model.vocab_size, (batch, seq + 1), device=device)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        optimizer.backward(loss)
        optimizer.step(job.train.lr)
        return loss

    losses, step_s, breakdown = timed_steps(step, steps, warmup, device, profile)
    tokens_per_s = batch * seq / step_s
    flops = model_flops_per_token(job.model, seq) * tokens_per_s
    peak = device_peak("bf16", device)
    return {
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "tokens_per_step": batch * seq,
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu_vs_bf16_peak": flops / peak.flops if peak else None,
        "peak_source": peak.source if peak else "none on CPU",
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
        "profile": breakdown,
    }


# torchtitan's activation checkpointing for the config's recompute (none: its AC off, as ours is off).
TITAN_AC = {"none": "none", "selective": "selective", "full": "full"}
TITAN_IMPL = "torchtitan {version} model + its AC/compile/AMP, our loop"


def run_titan_variant(
    config: Path,
    overrides: list[str],
    compile_mode: str,
    steps: int,
    warmup: int,
    device: str,
    profile: bool = False,
) -> dict[str, Any]:
    """torchtitan's LLaMA-3 at the job's dimensions in this loop (titan_peer.run), as run_variant's row."""
    import titan_peer

    job = load(config, overrides)
    torch.manual_seed(job.train.seed)
    batch, seq = job.train.micro_batch_size, job.model.seq_length
    result = titan_peer.run(
        titan_peer.dims_of(job.model),
        seq,
        batch,
        device,
        lr=job.train.lr,
        compile_model=compile_mode == "blocks",
        ac=TITAN_AC[job.model.recompute],
        timed=lambda step: timed_steps(step, steps, warmup, device, profile),
    )
    tokens_per_s = batch * seq / result["median_step_s"]
    flops = model_flops_per_token(job.model, seq) * tokens_per_s  # our formula, as for our rows
    peak = device_peak("bf16", device)
    return result | {
        "tokens_per_step": batch * seq,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu_vs_bf16_peak": flops / peak.flops if peak else None,
        "peak_source": peak.source if peak else "none on CPU",
    }


def run_isolated(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """run_variant(**spec) in a child process (this script with --variant); its row, or why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        row_file = Path(tmp) / "row.json"
        command = [sys.executable, __file__, "--variant", json.dumps(spec), "--out", str(row_file)]
        try:
            proc = subprocess.run(command, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": f"failed: still running after {timeout_s:.0f} s"}
        if row_file.exists():
            return json.loads(row_file.read_text())
        return {"status": f"failed: the variant's process exited with status {proc.returncode}"}


def run_one(spec_json: str, out: Path) -> int:
    """The child side of run_isolated: one variant, its row (or its exception) written to `out`."""
    spec = json.loads(spec_json)
    spec["config"] = Path(spec["config"])
    runner = run_titan_variant if spec.pop("kind", "llmtrain") == "torchtitan" else run_variant
    try:
        row = runner(**spec) | {"status": "ok"}
    except Exception as exc:  # out of memory, a compile failure, a peer's import error: in the row
        row = {"status": f"failed: {type(exc).__name__}: {exc}"[:400]}
    out.write_text(json.dumps(row, default=str))
    return 0


def torchtitan_status(rows: list[dict[str, Any]]) -> str:
    """The torchtitan side-by-side in a line: 'not installed', or the version and what its rows did."""
    version = peer_version("torchtitan")
    if version == "not installed":
        return version
    ours = [r for r in rows if r.get("impl", "").startswith("torchtitan")]
    ok = sum(r["status"] == "ok" for r in ours)
    return f"{version}, {ok} of {len(ours)} rows ok ({TITAN_IMPL.format(version=version)})"


def base_row(spec: dict[str, Any]) -> dict[str, Any]:
    config = Path(spec["config"]).name
    return {"config": config, "overrides": spec["overrides"], "compile": spec["compile_mode"]}


def run_row(spec: dict[str, Any], extra: dict[str, Any], budget: Budget) -> dict[str, Any]:
    """One variant's row: run in its own process, or skipped once the budget is spent."""
    row = base_row(spec) | extra
    precision = next(o for o in spec["overrides"] if o.startswith("train.precision=")).split("=")[1]
    if budget.spent():
        row["status"] = "skipped (time budget)"
    elif precision == "fp8" and peer_version("torchao") == "not installed":
        row["status"] = "skipped (torchao not installed)"
    else:
        what = f"{row['config']} {' '.join(row['overrides'])} compile={row['compile']}"
        print(f"== {row['impl']}: {what}", flush=True)
        # A variant started just before the budget ends may still finish within run_all.sh's margin.
        start = time.monotonic()
        row |= run_isolated(spec, timeout_s=budget.left() + 40)
        row["wall_s"] = time.monotonic() - start  # the process: start-up, build, compile, all steps
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--configs",
        type=Path,
        nargs="+",
        default=[ROOT / "configs/llama-1b.yaml", ROOT / "configs/llama-3b.yaml"],
    )
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "fp32"])
    parser.add_argument("--recompute", nargs="+", default=["config"], help="none/selective/full or config")
    parser.add_argument("--compile", nargs="+", default=["blocks", "none"], choices=["none", "blocks"])
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", "triton", "torch"],
        help="model.kernels: auto (Triton, with SDPA attention on CUDA), triton (our attention too) or torch",
    )
    parser.add_argument("--micro-batch", nargs="+", default=["config"], help="sizes, or config")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new variant after this")
    parser.add_argument(
        "--torchtitan",
        choices=["auto", "off"],
        default="auto",
        help="auto: a torchtitan row after each bf16 row of the first compile mode, where it is installed",
    )
    parser.add_argument(
        "--torchtitan-compile",
        choices=["blocks", "none"],
        default="blocks",
        help="torchtitan's per-block torch.compile (its recommended setting) or none",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every variant (e.g. an 8B-shaped stack: model.num_layers=16 ...)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="each row: one more step under torch.profiler, by category"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one variant (see run_isolated)
    args = parser.parse_args(argv)
    if args.variant:
        return run_one(args.variant, args.out)

    if args.dry_run:
        device, base, steps, warmup = "cpu", DRY_RUN_OVERRIDES, 3, 1
    elif torch.cuda.is_available():
        device, base, steps, warmup = "cuda", [], args.steps, args.warmup
    else:
        print("bench_e2e.py needs a CUDA GPU (or --dry-run on CPU); none found.")
        return 2
    budget = Budget(args.budget_s)
    titan = args.torchtitan == "auto" and peer_version("torchtitan") != "not installed"
    rows = []
    # Compiled rows first (the fastest setting measured, torchtitan's own recipe too), bf16 (the MFU target)
    # before fp8, so a short budget cuts the uncompiled and fp8 rows first. torchtitan's row follows our
    # first bf16 row of its config, so the side-by-side is measured before the budget ends. The dry run
    # keeps its PyTorch kernels (DRY_RUN_OVERRIDES).
    kernel_choices = [None] if args.dry_run else args.kernels
    grid = itertools.product(
        args.compile, kernel_choices, args.precision, args.configs, args.recompute, args.micro_batch
    )
    for compile_mode, kernel_impl, precision, config, recompute, micro in grid:
        overrides = [*base, *args.set, f"train.precision={precision}"]
        overrides += [] if kernel_impl is None else [f"model.kernels={kernel_impl}"]
        overrides += [] if recompute == "config" else [f"model.recompute={recompute}"]
        overrides += [] if micro == "config" else [f"train.micro_batch_size={micro}"]
        spec = dict(
            config=str(config),
            overrides=overrides,
            compile_mode=compile_mode,
            steps=steps,
            warmup=warmup,
            device=device,
            profile=args.profile,
        )
        rows.append(run_row(spec, {"impl": "llmtrain"}, budget))
        first_of_config = compile_mode == args.compile[0] and kernel_impl == kernel_choices[0]
        if precision == "bf16" and first_of_config and args.torchtitan != "off":
            titan_spec = spec | {"kind": "torchtitan", "compile_mode": args.torchtitan_compile}
            if not titan:
                rows.append(base_row(titan_spec) | {"impl": "torchtitan", "status": "not installed"})
                continue
            peer = {"impl": TITAN_IMPL.format(version=peer_version("torchtitan"))}
            rows.append(run_row(titan_spec, peer, budget))
    write_json(
        args.out,
        {
            "step": "e2e",
            "device": device_name(device),
            "rows": rows,
            "torchtitan": torchtitan_status(rows),
            "vs_torchtitan": vs_torchtitan(rows),
            "targets": {"mfu_1b": ">= 0.45", "vs_torchtitan": ">= 1.1x tokens/s"},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
