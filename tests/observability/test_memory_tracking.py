"""Measured peak memory per rank: the live-tensor tracker's exact bytes, the metrics.jsonl fields, and a
two-process run whose measured peaks the planner's memory model predicts."""

import json

import pytest
import torch

from llmtrain.config import load
from llmtrain.planner import CostModel, Software, Workload, cluster_from_dict
from llmtrain.planner.cost.layout import layout_of_job
from llmtrain.training.memory_tracking import PeakMemory
from llmtrain.training.metrics import memory_entry
from tests.training._runs import CONFIG, TINY, run_cli, torchrun_command

MB = 10**6


def test_live_tensor_peaks_are_exact_bytes():
    """4 MB + 2 MB live at startup (6 MB); the 2 MB freed, then 1 MB more in the steps: 5 MB."""
    memory = PeakMemory("cpu", track_cpu_tensors=True)
    with memory.tracking():
        a = torch.zeros(MB)  # 4 MB of fp32
        b = torch.zeros(MB // 2)
        del b
        memory.end_startup()
        c = torch.zeros(MB // 4)
        assert (memory.startup_bytes, memory.peak_bytes()) == (6 * MB, 5 * MB)
        del a, c
    assert memory.source == "live tensors"


def test_without_tracking_cpu_reports_peak_rss():
    memory = PeakMemory("cpu", track_cpu_tensors=False)
    with memory.tracking():
        memory.end_startup()
    assert memory.source == "max rss" and memory.startup_bytes is None and memory.peak_bytes() > 10 * MB


def test_metrics_rows_carry_every_ranks_peaks():
    gib = 2**30
    values = {"rank_peak_memory": [1.0 * gib, 2.0 * gib], "rank_startup_memory": [gib, gib]}
    entry = memory_entry({**values, "memory_source": "live tensors"}, torch.device("cpu"))
    assert entry == {
        "peak_memory_gb": 2.0,
        "rank_peak_memory_gb": [1.0, 2.0],
        "rank_startup_memory_gb": [1.0, 1.0],
        "memory_source": "live tensors",
    }
    assert set(memory_entry({}, torch.device("cpu"))) == {"peak_memory_gb"}


JOB = [
    "model.num_layers=2",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.seq_length=128",
    "parallel.dp=2",
    "parallel.zero_stage=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=3",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "train.num_threads=1",
    "checkpoint.interval=0",
    "logging.interval=1",
    "logging.tensorboard=false",
    "logging.memory=true",
]
LINK = {"bandwidth_gbs": 5, "latency_us": 20}
CPU = {
    "devices": {
        "cpu": {"peak_tflops": {"fp32": 1}, "memory_gb": 24, "memory_bandwidth_gbs": 20, "reserved_gb": 0}
    },
    "nodes": [{"count": 1, "devices_per_node": 2, "device": "cpu", "intra_link": "intra_node"}],
    "links": {"intra_node": LINK, "inter_node": LINK},
}


@pytest.mark.slow
def test_two_ranks_record_measured_peaks_the_memory_model_predicts(tmp_path):
    """dp=2 ZeRO-1 in fp32 on gloo: every rank's startup and step peaks land in metrics.jsonl, and the
    planner's memory model (PyTorch reference kernels, gloo shard exchange, nothing reserved) predicts them
    within 10% (benchmarks/bench_memory.py does the same for more layouts)."""
    done = run_cli(torchrun_command(2, tmp_path / "run", *JOB))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "rank_peak_memory_gb" in r][-1]
    assert last["memory_source"] == "live tensors" and len(last["rank_peak_memory_gb"]) == 2
    job = load(CONFIG, [*TINY, *JOB])  # the job torchrun_command starts
    software = Software(fused_kernels=False, gloo_shard_exchange=True)
    model = CostModel(Workload.from_job(job), cluster_from_dict(CPU).view(2), software)
    predicted = model.evaluate(layout_of_job(job, 2)).memory
    measured_step = max(last["rank_peak_memory_gb"]) * 2**30
    measured_startup = max(last["rank_startup_memory_gb"]) * 2**30
    assert predicted["steady"] == pytest.approx(measured_step, rel=0.10)
    assert predicted["startup"] == pytest.approx(measured_startup, rel=0.10)
