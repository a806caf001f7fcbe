"""Elastic restart under torchrun as launched, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a worker killed
with SIGKILL mid-training, the job restarts and resumes from the last complete checkpoint, for every layout
kind: tensor, pipeline (with tensor, and with per-layer stage and recompute plans), ZeRO-1, ZeRO-2/3 through
FSDP2 (with hybrid sharding), context parallelism (ring; all-to-all under ZeRO-3), expert parallelism and
DeepSpeed's engine (the layouts of benchmarks/fault_soak.py's KINDS). Reference: the same job run without
interruption (final loss equal, bit for bit); and a 4-worker checkpoint resumed on 2 workers (resharded, loss
within fp32 tolerance)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from llmtrain.config import load
from llmtrain.parallel.launch import launch_store, restart_warnings

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
# Steps heavy enough (~0.2 s on an idle machine) that the kill lands well inside steps 11-20.
OVERRIDES = [
    f"train.steps={STEPS}", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "model.ffn_hidden_size=256", "model.seq_length=256", "model.kernels=torch",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_interval=0", "train.num_threads=1",
    "checkpoint.interval=5", "logging.tensorboard=false", "logging.interval=1",
]  # fmt: skip
# The variable that works around torchrun's shared store; the restarts must work without it.
SHARE_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _torchrun(nproc: int, out: Path, *extra: str) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", f"--nproc-per-node={nproc}",
        "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        str(ROOT / "tools" / "pretrain.py"), "--config", str(ROOT / "configs" / "ernie.yaml"),
        *OVERRIDES, f"output_dir={out}", *extra,
    ]  # fmt: skip
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed with the process by the caller
    env = {k: v for k, v in os.environ.items() if k != SHARE_STORE_OPT_OUT}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _final_loss(out: Path) -> tuple[int, float]:
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return last["step"], last["loss"]


def _latest_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def _kill_a_worker_and_compare(tmp_path: Path, *layout: str) -> float:
    """Run `layout` on 4 workers twice, SIGKILL a worker of one run after its step-10 checkpoint, and
    check that it resumes to the other's final loss bit for bit; return that loss."""
    reference = _torchrun(4, tmp_path / "reference", *layout)
    killed = _torchrun(4, tmp_path / "killed", *layout)
    victim = None
    deadline = time.time() + 500
    while killed.poll() is None and time.time() < deadline:
        if victim is None and 10 <= _latest_step(tmp_path / "killed") < STEPS:
            # torchrun's own children with a LOCAL_RANK are the workers (not helpers they may fork).
            workers = [p for p in psutil.Process(killed.pid).children() if "LOCAL_RANK" in p.environ()]
            victim = workers[-1].pid
            psutil.Process(victim).send_signal(signal.SIGKILL)
        time.sleep(0.05)
    assert reference.wait(timeout=max(1, deadline - time.time())) == 0, (
        tmp_path / "reference.log"
    ).read_text()[-5000:]
    assert killed.wait(timeout=10) == 0, (tmp_path / "killed.log").read_text()[-5000:]
    log = (tmp_path / "killed.log").read_text()
    assert victim is not None, "training ended before a worker could be killed"
    # Whether torchrun or the survivors' fail-fast handler notices the dead peer first varies, and so does
    # the log; what must hold is that the victim died and the restarted group resumed from a checkpoint
    # (the run started in an empty output_dir, so "resumed from" only appears after a restart).
    assert not psutil.pid_exists(victim), f"worker {victim} survived its SIGKILL"
    assert "resumed from" in log, log[-3000:]
    final_step, final_loss = _final_loss(tmp_path / "reference")
    assert final_step == STEPS
    assert _final_loss(tmp_path / "killed") == (final_step, final_loss)  # bit for bit
    return final_loss


@pytest.mark.slow
def test_sigkill_restart_resumes_tensor_parallel_and_reshards(tmp_path: Path) -> None:
    final_loss = _kill_a_worker_and_compare(tmp_path, "parallel.tp=2")

    # The 4-worker checkpoint (tp=2 dp=2) resumed on 2 workers (tp=2 dp=1) from its step 15. Sharding the
    # batch differently changes only the order of fp32 sums, so the loss stays within a few ulps per step.
    start = tmp_path / "reference" / "checkpoints" / "step_15"
    smaller = _torchrun(2, tmp_path / "two", "parallel.tp=2", f"checkpoint.load={start}")
    assert smaller.wait(timeout=300) == 0, (tmp_path / "two.log").read_text()
    step, loss = _final_loss(tmp_path / "two")
    assert step == STEPS and "resumed from" in (tmp_path / "two.log").read_text()
    assert abs(loss - final_loss) <= 1e-5 * abs(final_loss)


# Each kind builds process groups of its own on every attempt (pipeline stages, ZeRO buckets, FSDP2's
# meshes, CP rings and all-to-all groups, EP groups, DeepSpeed's engine), so each gets a kill of its own.
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.pp=2"),
        ("parallel.zero_stage=1",),
        ("parallel.cp=2",),
        ("parallel.cp=2", "parallel.cp_comm=all_to_all", "parallel.zero_stage=3"),
        ("parallel.zero_stage=2", "parallel.dp_shard=2"),
        ("model.arch=mixtral", "model.num_experts=4", "parallel.ep=2"),
        ("parallel.tp=2", "parallel.pp=2", "parallel.stage_layers=[1,1]",
         "model.recompute_layers=[full,selective]"),
        ("parallel.engine=deepspeed", "parallel.zero_stage=3"),
    ],
    ids=[
        "tp2-pp2", "dp4-zero1", "cp2-ring", "cp2-a2a-zero3", "dp4-zero2-hsdp", "ep2-moe", "tp2-pp2-per-layer",
        "deepspeed-zero3",
    ],
)  # fmt: skip
def test_sigkill_restart_resumes_every_layout_kind(tmp_path: Path, layout: tuple[str, ...]) -> None:
    _kill_a_worker_and_compare(tmp_path, *layout)


def _join(world: int) -> list[dist.Store]:
    """launch_store for ranks 0..world-1 of one launch, joining at once as a launch's workers do."""
    with ThreadPoolExecutor(world) as pool:
        return list(
            pool.map(lambda rank: launch_store(rank, world, datetime.timedelta(seconds=30)), range(world))
        )


def test_each_launch_gets_a_namespace_of_its_own_in_the_shared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent hosts one store for all launches of a job; a restarted launch must not see what the
    one before wrote, even when dead workers left requests in the queue the launches meet through."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    first = _join(3)
    for rank, store in enumerate(first):
        store.set(f"address/{rank}", "of a worker about to die")
    # A worker of an attempt that died while joining: its request stays in the queue, unanswered.
    dist.PrefixStore("llmtrain/job/", agent_store).queue_push("hello", "a dead worker's nonce")
    second = _join(3)
    assert not any(store.check(["address/0"]) for store in second)
    second[0].set("shared", "by this launch")
    assert [store.get("shared") for store in second] == [b"by this launch"] * 3
    assert not first[1].check(["shared"])


def test_restart_warnings_when_torchrun_restarts_but_nothing_is_saved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_saves = load(
        ROOT / "configs" / "ernie.yaml", ["checkpoint.interval=0", "checkpoint.interval_minutes=0"]
    )
    for name in ("TORCHELASTIC_MAX_RESTARTS", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert restart_warnings(no_saves) == []  # no restarts: nothing a restart could lose
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    [warning] = restart_warnings(no_saves)
    assert "checkpoint.interval" in warning
    assert restart_warnings(load(ROOT / "configs" / "ernie.yaml", ["checkpoint.interval_minutes=0"])) == []


def test_restart_warnings_when_agents_share_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    job = load(ROOT / "configs" / "ernie.yaml")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert restart_warnings(job) == []  # one agent: its store is the only one
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    [warning] = restart_warnings(job)
    assert f"{SHARE_STORE_OPT_OUT}=1" in warning
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what torchrun sets when it is exported
    assert restart_warnings(job) == []
