"""Fault soak: SIGKILL a random worker at random steps under torchrun's restarts, on a busy machine.

One tiny job is trained twice by torchrun as a user launches it (c10d rendezvous, the agent's shared
store, no TORCH_DISABLE_SHARE_RDZV_TCP_STORE): once uninterrupted (the reference), and once with
`--max-restarts N` while this script kills a random worker N times, each at a distinct random step, waiting
for the restarted attempt to log a step before the next kill. With --busy (the default) one busy-loop
process per core competes with the job the whole time. The soak passes when torchrun exits 0 after exactly
N restarts (the i-th kill hits attempt i) and every step's loss equals the reference's bit for bit (so the
final loss does too); steps re-run after a restart must reproduce the loss they logged before it. It prints
the kills, the restarts (and how many resumed from a checkpoint), the steps each restart re-ran, the load
average at the start and the end, and one Markdown row for README's fault-tolerance table.

  python benchmarks/fault_soak.py                        # 20 kills, tp 2 x pp 2 on 4 workers
  python benchmarks/fault_soak.py --kills 5 --kind ep2-moe --no-busy
  python benchmarks/fault_soak.py --kills 5 --layout parallel.zero_stage=1 --no-busy
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from llmtrain.training.metrics_file import latest_per_step, read_rows

ROOT = Path(__file__).resolve().parents[1]
# A step of ~0.3 s on an idle 2-core machine: long enough that a kill lands inside the step it aims at.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=128", "model.kernels=torch", "train.global_batch_size=8",
    "train.micro_batch_size=2", "train.warmup_steps=2", "train.eval_interval=0", "train.num_threads=1",
    "logging.tensorboard=false", "logging.interval=1",
]  # fmt: skip
SHARE_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Every layout kind on 4 workers, by name: each builds its own process groups (FSDP meshes, EP all-to-all
# groups, CP rings, DeepSpeed's engine) and so is its own chance to leak state from one attempt into the next.
KINDS: dict[str, list[str]] = {
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2"],
    "dp4-zero1": ["parallel.zero_stage=1"],
    "cp2-ring": ["parallel.cp=2"],
    "cp2-a2a-zero3": ["parallel.cp=2", "parallel.cp_comm=all_to_all", "parallel.zero_stage=3"],
    "dp4-zero2-hsdp": ["parallel.zero_stage=2", "parallel.dp_shard=2"],
    "ep2-moe": ["model.arch=mixtral", "model.num_experts=4", "parallel.ep=2"],
    "ep2-cp2": ["model.arch=mixtral", "model.num_experts=4", "parallel.ep=2", "parallel.cp=2"],
    "tp2-pp2-per-layer": [
        "parallel.tp=2", "parallel.pp=2", "parallel.stage_layers=[1,1]",
        "model.recompute_layers=[full,selective]",
    ],
    "deepspeed-zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
    "deepspeed-zero3": ["parallel.engine=deepspeed", "parallel.zero_stage=3"],
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags: number of kills, job size and layout, load, seed and where runs go."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--kills", type=int, default=20, help="SIGKILLs to inject (torchrun gets as many restarts)"
    )
    p.add_argument("--nproc", type=int, default=4, help="workers")
    p.add_argument("--kind", choices=sorted(KINDS), default="tp2-pp2", help="a named layout (see KINDS)")
    p.add_argument("--layout", nargs="*", default=None, help="config overrides instead of --kind's")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: 3 per kill)")
    p.add_argument("--checkpoint-interval", type=int, default=2, help="checkpoint.interval of the job")
    p.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True, help="a busy loop per core")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill steps and victims")
    p.add_argument("--output", type=Path, default=None, help="directory for both runs (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the soak is declared hung")
    return p.parse_args(argv)


def torchrun(args: argparse.Namespace, out: Path, max_restarts: int) -> subprocess.Popen:
    """Start the job under torchrun in its own session (so a hang can be ended as a group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", f"--nproc-per-node={args.nproc}",
        f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        str(ROOT / "tools" / "pretrain.py"), "--config", str(ROOT / "configs" / "ernie.yaml"), *TINY,
        f"train.steps={args.steps}", f"checkpoint.interval={args.checkpoint_interval}", *args.layout,
        f"output_dir={out}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != SHARE_STORE_OPT_OUT}
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
    )


def wait_or_end(proc: subprocess.Popen, deadline: float) -> int:
    """The exit code of `proc`, or -1 after ending its whole session when it outlives `deadline`."""
    try:
        return proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        # torchrun's workers can sit in sessions of their own (seen: four left running after a timeout),
        # so every descendant is ended by pid as well as the session.
        family = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for member in family:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                continue
        proc.wait()
        return -1


def spin() -> None:
    """Keep one core busy until terminated."""
    while True:
        pass


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """torchrun's own children with a LOCAL_RANK: the workers of the attempt now running."""
    found = []
    for child in psutil.Process(proc.pid).children():
        try:
            if "LOCAL_RANK" in child.environ():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def soak(args: argparse.Namespace, out: Path, deadline: float) -> tuple[int, list[tuple[int, int, int]]]:
    """Run the job with kills at random steps; return torchrun's exit code and, for each kill, the step,
    the victim's rank and its attempt (TORCHELASTIC_RESTART_COUNT)."""
    rng = random.Random(args.seed)
    targets = sorted(rng.sample(range(1, args.steps), args.kills))
    proc = torchrun(args, out, max_restarts=args.kills)
    kills: list[tuple[int, int, int]] = []
    killed_segment = -1
    while proc.poll() is None and time.time() < deadline and len(kills) < len(targets):
        rows = [r for r in read_rows(out) if "eval_loss" not in r and r.get("segment", 0) > killed_segment]
        if rows and rows[-1]["step"] >= targets[len(kills)]:
            running = workers(proc)
            if len(running) == args.nproc:
                victim = rng.choice(running)
                victim_env = victim.environ()
                victim.send_signal(signal.SIGKILL)
                attempt = int(victim_env["TORCHELASTIC_RESTART_COUNT"])
                kills.append((rows[-1]["step"], int(victim_env["RANK"]), attempt))
                killed_segment = rows[-1].get("segment", 0)
        time.sleep(0.02)
    return wait_or_end(proc, deadline), kills


@dataclass
class Comparison:
    """The soak's training rows against the uninterrupted reference's."""

    restarts: int  # launches after the first
    steps_lost: list[int]  # per restart, the steps it re-ran (logged by an earlier launch already)
    rerun_differ: int  # re-run steps whose loss differs from the one first logged
    missing: list[int]  # steps never logged
    differ: list[int]  # steps whose last logged loss differs from the reference's
    final_loss: float | None
    reference_loss: float | None


def compare(reference_rows: list[dict], soak_rows: list[dict], steps: int) -> Comparison:
    """Compare a soak's metrics rows (every launch's, in file order) with the reference run's."""
    reference = {r["step"]: r["loss"] for r in latest_per_step(reference_rows)}
    train_rows = [r for r in soak_rows if "eval_loss" not in r]
    final = {r["step"]: r["loss"] for r in latest_per_step(train_rows)}
    first_loss: dict[int, float] = {}
    # Each launch after the first logs under a new segment number.
    lost: dict[int, int] = {}
    rerun_differ = 0
    for row in train_rows:
        segment = row.get("segment", 0)
        if segment:
            lost.setdefault(segment, 0)
        if row["step"] in first_loss:
            lost[segment] += 1
            rerun_differ += row["loss"] != first_loss[row["step"]]
        first_loss.setdefault(row["step"], row["loss"])
    return Comparison(
        restarts=len(lost),
        steps_lost=[lost[segment] for segment in sorted(lost)],
        rerun_differ=rerun_differ,
        missing=sorted(set(range(1, steps + 1)) - set(final)),
        differ=sorted(s for s in final if final[s] != reference.get(s)),
        final_loss=final.get(steps),
        reference_loss=reference.get(steps),
    )


def resumed_launches(out: Path) -> int:
    """How many launches of the run in `out` resumed from a checkpoint (a kill before the first save
    restarts from scratch)."""
    path = out / "launches.jsonl"
    launches = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(launch.get("resumed_from") is not None for launch in launches)


def load_average() -> str:
    """The 1-minute load average, as evidence of how busy the machine was."""
    return f"{os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.steps = args.steps or 3 * args.kills
    name = args.kind if args.layout is None else " ".join(args.layout)
    if args.layout is None:
        args.layout = KINDS[args.kind]
    if args.kills >= args.steps:
        raise SystemExit(f"--kills {args.kills} needs more than {args.kills} --steps (one kill per step)")
    out = args.output or Path(tempfile.mkdtemp(prefix="fault_soak_"))
    out.mkdir(parents=True, exist_ok=True)
    for run in ("reference", "soak"):
        if (out / run).exists():
            raise SystemExit(f"{out / run} exists; pass an empty --output")
    load_start = load_average()
    started = time.time()
    deadline = started + args.timeout
    busy = [
        multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1) if args.busy
    ]
    for p in busy:
        p.start()
    try:
        reference_code = wait_or_end(torchrun(args, out / "reference", max_restarts=0), deadline)
        soak_code, kills = soak(args, out / "soak", deadline)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    elapsed = time.time() - started
    load_end = load_average()

    result = compare(read_rows(out / "reference"), read_rows(out / "soak"), args.steps)
    resumed = resumed_launches(out / "soak")
    attempts = [attempt for _, _, attempt in kills]

    print(f"layout: {' '.join(args.layout)} on {args.nproc} workers, {args.steps} steps, "
          f"checkpoint every {args.checkpoint_interval}, busy loops: {len(busy)}, output {out}")  # fmt: skip
    print(
        f"runtime: {elapsed:.0f} s (reference and soak); "
        f"load average {load_start} at the start, {load_end} at the end"
    )
    print(f"faults injected: {len(kills)} SIGKILLs (step, rank, attempt): {kills}")
    print(
        f"restarts: {result.restarts}, {resumed} of them resumed from a checkpoint "
        f"(torchrun exit code {soak_code}; reference exit code {reference_code})"
    )
    print(
        f"steps lost: {sum(result.steps_lost)} re-run steps, per restart {result.steps_lost}, "
        f"{sum(result.steps_lost) - result.rerun_differ} of them reproduced their first loss"
    )
    print(
        "data lost: "
        + (
            "none"
            if not result.missing and not result.differ
            else f"steps missing {result.missing}, loss differs at {result.differ}"
        )
        + f"; final loss {result.final_loss} vs reference {result.reference_loss}"
    )
    ok = (
        reference_code == 0
        and soak_code == 0
        and len(kills) == args.kills
        and result.restarts == args.kills
        and attempts == list(range(args.kills))
        and not result.missing
        and not result.differ
        and result.rerun_differ == 0
        and result.final_loss is not None
    )
    # One Markdown table row per soak, as README's fault-tolerance table records it.
    print(
        f"| {name} | {len(kills)} "
        f"| {result.restarts} ({resumed} from a checkpoint) | {sum(result.steps_lost)} "
        f"({max(result.steps_lost, default=0)} at most) | {result.final_loss} "
        f"| {'bit for bit' if result.final_loss == result.reference_loss else 'differs'} | {elapsed:.0f} s "
        f"| {load_start} / {load_end} | {'PASS' if ok else 'FAIL'} |"
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
