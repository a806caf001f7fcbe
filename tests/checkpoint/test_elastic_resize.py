"""Elastic resize under torchrun: two agents (`--nnodes=1:2`, 2 workers each) on this machine train one job
with parallel.auto. One agent crashes (it and its workers SIGKILLed): the other goes on alone at world size 2
from the last checkpoint with a layout planned for 2. The agent comes back: the job grows to 4 again.
Reference for each segment after a change: the same job resumed by hand (one launch, that many workers)
from the checkpoint the segment resumed from; every step both logged has the same loss, bit for bit (same
layout, same shards, same data order, one thread per process). The agents run with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's shared store a change of membership can split the workers
between two stores (see `_agent`), which the job warns about at start.

The agent that comes back must join while the job still runs at world size 2, however long it takes to start
on a loaded machine: once the size-2 segment has logged its first steps, its workers are stopped (SIGSTOP)
until torchrun's own SIGTERM for the membership change reaches them, then continued to handle it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from llmtrain.config import JobConfig, load
from llmtrain.planner import plan_for_world
from llmtrain.training.metrics_file import read_rows
from tests.checkpoint._ranks import pretrain
from tests.checkpoint._util import kill_launch, signal_all
from tests.parallel._dist import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ernie.yaml"
STEPS = 24
OVERRIDES = [
    f"train.steps={STEPS}", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.seq_length=128", "model.kernels=torch",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=2", "train.eval_interval=0",
    "train.num_threads=1", "checkpoint.interval=5", "checkpoint.keep=100", "logging.tensorboard=false",
    "logging.interval=1", "parallel.auto=true",
]  # fmt: skip
# A fixed description of this machine for parallel.auto: measured at each launch instead (no
# parallel.cluster), the figures vary with the load, and so could the layout the hand-resumed reference
# gets. On it the planner picks dp=4 x micro-batch 2 for 4 workers and dp=2 x micro-batch 4 for 2 (ZeRO-1).
CLUSTER = """
name: two-cpu-cores
devices:
  cpu:
    peak_tflops: {fp32: 0.02, bf16: 0.01}
    memory_gb: 6
    memory_bandwidth_gbs: 5
    gemm_efficiency: 1.0
    memory_efficiency: 1.0
    attention_efficiency: 0.5
    kernel_overhead_us: 10.0
    reserved_gb: 0.5
nodes:
  - {count: 1, devices_per_node: 4, device: cpu, intra_link: intra_node}
links:
  intra_node: {bandwidth_gbs: 2.0, latency_us: 60, efficiency: 1.0}
  inter_node: {bandwidth_gbs: 2.0, latency_us: 60, efficiency: 1.0}
"""
# Small rendezvous timeouts so that a change of membership settles in seconds: a round with both agents
# closes at once; one with a single agent closes 15 s after it joined (time for the other to join too: at
# 5 s, on a loaded machine the second agent, still importing torch, missed the first round and the job
# started at world size 2); a crashed agent stops counting 5 s after its last heartbeat.
RDZV_CONF = "last_call_timeout=15,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=5"


def _overrides(out: Path) -> list[str]:
    """The job's overrides, with the cluster file written next to `out` (every run of a test shares it)."""
    cluster = out.parent / "cluster.yaml"
    if not cluster.exists():
        cluster.write_text(CLUSTER)
    return [*OVERRIDES, f"parallel.cluster={cluster}", f"output_dir={out}"]


def _pretrain(out: Path, *extra: str) -> list[str]:
    return [str(ROOT / "tools" / "pretrain.py"), "--config", str(CONFIG), *_overrides(out), *extra]


def _start(cmd: list[str], log: Path, **env_vars: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"} | env_vars
    handle = open(log, "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _agent(name: str, port: int, out: Path, host: bool) -> subprocess.Popen:
    """One torchrun agent of the elastic job; `host` says whether it hosts the rendezvous store."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=resize", "--max-restarts=3",
        f"--rdzv-conf={RDZV_CONF},is_host={str(host).lower()}", *_pretrain(out),
    ]  # fmt: skip
    # torch's dynamic rendezvous hands each agent's workers the store address of the round that agent first
    # joined; once the agent that hosts the shared store changes (the agent that came back sorts first),
    # the two agents' workers are sent to different stores and wait for each other forever. Without the
    # shared store, rank 0's worker hosts a new store every round. The job says so at start (launch.py).
    return _start(cmd, out.parent / f"{name}.log", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _field(job: JobConfig, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(job, section), name)


def _launches(out: Path) -> list[dict]:
    path = out / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _latest_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def _wait_for(
    condition: Callable[[], object], what: str, procs: list[subprocess.Popen], deadline: float
) -> None:
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"an agent ended while waiting for {what}"
        time.sleep(0.1)


def _segment_steps(out: Path, segment: int) -> int:
    return sum(1 for r in read_rows(out) if r.get("segment") == segment and "eval_loss" not in r)


def _sigterm_pending(process: psutil.Process) -> bool:
    """Whether a SIGTERM waits to be delivered to a stopped process (the masks of /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return any(
        line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit
        for line in status.splitlines()
    )


@pytest.mark.slow
def test_agent_lost_and_back_shrinks_and_grows_with_replanned_layout(tmp_path: Path) -> None:
    out = tmp_path / "elastic"
    port = free_port()
    deadline = time.time() + 600
    first = _agent("first", port, out, host=True)
    second = _agent("second", port, out, host=False)
    try:
        _wait_for(
            lambda: _launches(out) and _launches(out)[-1]["world_size"] == 4 and _latest_step(out) >= 10,
            "the step-10 checkpoint at world size 4",
            [first, second],
            deadline,
        )
        kill_launch(second)  # the agent and its workers, as a lost machine
        _wait_for(
            lambda: (
                _launches(out)[-1]["world_size"] == 2
                and _segment_steps(out, _launches(out)[-1]["segment"]) >= 2
            ),
            "two steps at world size 2",
            [first],
            deadline,
        )
        # The agent coming back takes 5-60 s to start and join, depending on the load: the size-2 workers wait
        # for it, stopped, so that the job cannot finish first. When it has joined, the first agent stops its
        # workers for the new round with SIGTERM, which they save a checkpoint on once continued.
        workers = psutil.Process(first.pid).children(recursive=True)
        signal_all(workers, signal.SIGSTOP)
        second = _agent("second-again", port, out, host=False)
        _wait_for(
            lambda: any(_sigterm_pending(w) for w in workers),
            "the SIGTERM of the new round",
            [first, second],
            deadline,
        )
        signal_all(workers, signal.SIGCONT)
        assert first.wait(timeout=max(1, deadline - time.time())) == 0, (tmp_path / "first.log").read_text()
        assert second.wait(timeout=60) == 0, (tmp_path / "second-again.log").read_text()
    finally:
        for agent in (first, second):
            kill_launch(agent)

    launches = _launches(out)
    sizes = [launch["world_size"] for launch in launches]
    # Each change can take more than one launch (a restart can meet the other agent still joining); what
    # must hold is 4 workers, then 2, then 4 again to the end.
    collapsed = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert collapsed == [4, 2, 4], launches
    plans = {size: plan_for_world(load(CONFIG, _overrides(out)), size)[0] for size in (2, 4)}
    assert plans[2] != plans[4], plans
    rows = [r for r in read_rows(out) if "eval_loss" not in r]
    assert max(r["step"] for r in rows) == STEPS

    changes = [launch for i, launch in enumerate(launches) if i and launch["world_size"] != sizes[i - 1]]
    for change in changes:
        assert change["resumed_from"], change
        # The layout the segment ran is the planner's for its world size (and the two sizes' plans differ).
        ran = load(out / change["config"])
        assert {key: _field(ran, key) for key in plans[change["world_size"]]} == plans[change["world_size"]]
        by_hand = tmp_path / f"by_hand_{change['segment']}"
        # One launch of that many ranks resumed by hand; the ranks are forked, as torchrun would start them
        # (tests.checkpoint._ranks): the elastic launches above are what is tested, this is the reference.
        resumed = pretrain(
            change["world_size"], _pretrain(by_hand, f"checkpoint.load={change['resumed_from']}")[1:]
        )
        assert resumed.returncode == 0, resumed.stderr
        expected = {r["step"]: r["loss"] for r in read_rows(by_hand) if "eval_loss" not in r}
        segment = [(r["step"], r["loss"]) for r in rows if r["segment"] == change["segment"]]
        assert segment, f"segment {change['segment']} logged no step"
        assert segment == [(step, expected[step]) for step, _ in segment]
