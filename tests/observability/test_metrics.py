"""MetricsLogger: MFU against hand-computed FLOPs, metrics.jsonl (append-only, segments), console and
TensorBoard; device peaks (datasheet, configured, measured on CUDA, none on CPU)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llmtrain.config import JobConfig, ModelConfig
from llmtrain.planner.cost.flops import model_flops_per_token
from llmtrain.training.metrics import MetricsLogger
from llmtrain.training.metrics_file import latest_per_step, read_rows
from llmtrain.training.peak import Peak, device_peak, gpu_peak_tflops, measured_matmul_tflops

TERA = Peak(1e12, "logging.peak_tflops")


def job_for(tmp_path, steps: int = 6, interval: int = 2, **model) -> JobConfig:
    job = JobConfig(model=ModelConfig(**model))
    job.train.steps = steps
    job.logging.interval = interval
    job.output_dir = str(tmp_path / "run")
    return job


def step_values(step: int, tokens: int = 4096, step_time: float = 0.5, **extra) -> dict:
    values = {
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3 * step,
        "grad_norm": 1.0 + step,
        "loss_scale": None,
        "skipped_steps": 0,
        "tokens": tokens,
        "samples": tokens // 128,
        "step_time": step_time,
        "data_time": 0.01,
    }
    values.update(extra)
    return values


def read_jsonl(job: JobConfig) -> list[dict]:
    with open(f"{job.output_dir}/metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


# --- MFU against hand-computed FLOPs -------------------------------------------------------------


def test_mfu_gpt_matches_megatron_closed_form_on_published_row(tmp_path):
    """Megatron-LM SC21 Table 1, 1.7B row (llmtrain/planner/data/megatron_a100_2021.csv): 32 A100s, batch 512,
    seq 2048, 137 TFLOP/s/GPU counted with full recompute (the 96-factor formula). Our MFU counts no
    recompute, i.e. the 72-factor closed form 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) over the same time."""
    B, s, L, h, V, gpus = 512, 2048, 24, 2304, 51200, 32  # the paper's symbols
    job = job_for(
        tmp_path,
        steps=1,
        arch="gpt",
        num_layers=L,
        hidden_size=h,
        num_attention_heads=24,
        vocab_size=V,
        seq_length=s,
    )
    job.logging.peak_tflops = 312.0  # A100 dense bf16
    job.logging.tensorboard = False
    with_recompute = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    model_flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    step_time = with_recompute / (gpus * 137e12)  # the published per-GPU throughput
    logger = MetricsLogger(job, True, model_flops_per_token(job.model, s), gpus, stream=io.StringIO())
    logger.log_step(1, step_values(1, tokens=B * s, step_time=step_time))
    logger.close()
    entry = read_jsonl(job)[0]
    expected_tflops = model_flops / step_time / gpus / 1e12
    assert entry["tflops_per_device"] == pytest.approx(expected_tflops, rel=1e-9)
    assert entry["tflops_per_device"] == pytest.approx(
        137 * 72 / 96 * (1 + s / (6 * h) + V / (12 * L * h)) / (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-9
    )
    assert entry["mfu"] == pytest.approx(expected_tflops / 312, rel=1e-9)
    assert entry["tokens_per_sec"] == pytest.approx(B * s / step_time)


def test_moe_router_metrics_reach_jsonl_and_console(tmp_path):
    """aux_loss, z_loss, the dropped fraction and the expert load (overall and per layer) are logged when the
    step has them (a mixture of experts) and absent otherwise, so a dense run's metrics.jsonl keeps its keys;
    the console shows the dropped share only when tokens were dropped."""
    job = job_for(tmp_path, steps=3, interval=1, arch="mixtral", num_experts=3)
    job.logging.tensorboard = False
    stream = io.StringIO()
    logger = MetricsLogger(job, True, 1.0, 1, stream=stream)
    moe = dict(aux_loss=2.5, z_loss=7.25, expert_load_max=30.0, expert_load_mean=20.0)
    logger.log_step(1, step_values(1, **moe, dropped_fraction=0.125, expert_load_layers=[1.5, 1.25]))
    logger.log_step(2, step_values(2))
    logger.log_step(3, step_values(3, **moe, dropped_fraction=0.0, expert_load_layers=[1.5, 1.25]))
    logger.close()
    first, second, third = read_jsonl(job)
    assert {k: first[k] for k in moe} == moe
    assert (first["dropped_fraction"], first["expert_load_layers"]) == (0.125, [1.5, 1.25])
    assert not {*moe, "dropped_fraction", "expert_load_layers"} & set(second)
    lines = stream.getvalue().splitlines()
    assert "aux 2.500 | z 7.25 | dropped 12.5% | expert load max/mean 1.50" in lines[0]
    assert "aux 2.500 | z 7.25 | expert load max/mean 1.50" in lines[2]


def test_moe_flops_count_the_routed_experts_only(tmp_path):
    """Qwen3-MoE with a dense first layer: an MoE layer's MLP runs its router, then top-k experts of
    moe_ffn_hidden_size; the dense layer its ffn_hidden_size MLP. Counted by hand against llama's."""
    h, f, fe, experts, k, layers = 64, 96, 24, 7, 3, 3
    sizes = dict(num_layers=layers, hidden_size=h, num_attention_heads=4, vocab_size=300, ffn_hidden_size=f)
    dense = job_for(tmp_path, steps=1, arch="llama", **sizes).model
    moe = job_for(
        tmp_path,
        steps=1,
        arch="qwen3_moe",
        num_experts=experts,
        num_experts_per_tok=k,
        moe_ffn_hidden_size=fe,
        dense_layers=[0],
        **sizes,
    ).model
    dense_mlp = 2 * 3 * h * f
    moe_mlp = 2 * h * experts + k * 2 * 3 * h * fe  # router scores + k gated experts
    expected = model_flops_per_token(dense) + 3 * (layers - 1) * (moe_mlp - dense_mlp)
    assert model_flops_per_token(moe) == pytest.approx(expected, rel=1e-12)


def test_mfu_llama_gqa_counted_by_hand(tmp_path):
    """LLaMA with grouped-query attention and a gated MLP, each matmul counted by hand (2 FLOPs per MAC)."""
    h, heads, kv, d, f, V, s, layers = 256, 8, 2, 32, 704, 1000, 64, 3
    job = job_for(
        tmp_path,
        steps=1,
        arch="llama",
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        num_kv_heads=kv,
        vocab_size=V,
        seq_length=s,
    )
    assert job.model.ffn_size == f  # 8/3 * 256 = 682.7, rounded up to a multiple of 64
    job.logging.peak_tflops = 2.0
    job.logging.tensorboard = False
    q = 2 * h * heads * d  # 131072
    k_and_v = 2 * 2 * h * kv * d  # 65536
    scores_and_context = 2 * 2 * s * heads * d  # 65536: full s x s square, as Megatron counts
    out = 2 * heads * d * h  # 131072
    mlp = 2 * 3 * h * f  # gate, up, down: 1081344
    logits = 2 * h * V  # 512000
    per_token = 3 * (layers * (q + k_and_v + scores_and_context + out + mlp) + logits)
    assert per_token == 3 * (3 * 1474560 + 512000)
    flops_per_token = model_flops_per_token(job.model, s)
    assert flops_per_token == per_token
    world, tokens, step_time = 4, 8 * s, 0.25
    logger = MetricsLogger(job, True, flops_per_token, world, stream=io.StringIO())
    logger.log_step(1, step_values(1, tokens=tokens, step_time=step_time))
    logger.close()
    entry = read_jsonl(job)[0]
    assert entry["mfu"] == pytest.approx(per_token * tokens / step_time / (world * 2.0e12), rel=1e-12)


# --- metrics.jsonl, console ------------------------------------------------------------------------


def test_jsonl_entries_per_interval_and_last_step(tmp_path):
    job = job_for(tmp_path, steps=5, interval=2)
    job.logging.tensorboard = False
    console = io.StringIO()
    logger = MetricsLogger(job, True, 1e6, 2, peak=TERA, stream=console)
    times = [0.5, 0.3, 0.2, 0.4, 0.1]
    for step, t in enumerate(times, 1):
        skipped = int(step >= 3)
        logger.log_step(step, step_values(step, tokens=1000 * step, step_time=t, skipped_steps=skipped))
    logger.log_eval(5, 2.0)
    logger.close()
    entries = read_jsonl(job)
    assert [e["step"] for e in entries] == [2, 4, 5, 5]
    second = entries[1]  # the window of steps 3 and 4
    assert second["tokens_per_sec"] == pytest.approx((3000 + 4000) / (0.2 + 0.4))
    assert second["samples_per_sec"] == pytest.approx((3000 // 128 + 4000 // 128) / 0.6)
    assert second["step_time_s"] == pytest.approx(0.3)
    assert second["loss"] == pytest.approx(5.0 - 0.4)
    assert second["loss_avg"] == pytest.approx(5.0 - 0.35)
    assert second["eta_s"] == pytest.approx(0.3 * 1)
    assert second["skipped_steps"] == 1
    assert second["mfu"] == pytest.approx(1e6 * 7000 / 0.6 / 2 / 1e12)
    required = {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "elapsed_s",
        "samples_per_sec",
        "step_time_s",
        "tflops_per_device",
        "mfu",
        "loss_scale",
        "skipped_steps",
        "peak_memory_gb",
        "data_time_s",
        "eta_s",
    }
    assert required <= set(entries[0])
    assert entries[2]["eta_s"] == 0.0
    assert entries[3]["eval_loss"] == 2.0 and entries[3]["eval_ppl"] == pytest.approx(math.exp(2.0))
    lines = console.getvalue().splitlines()
    heads = [line.split("|")[0].strip() for line in lines]
    assert heads == ["step 2/5", "step 4/5", "step 5/5", "eval step 5/5"]
    assert "MFU" in lines[0] and "tok/s" in lines[0] and "ETA" in lines[0]
    assert lines[1].split(" | ")[1] == f"loss {5.0 - 0.35:.4f}"  # the interval's mean, not step 4's
    assert {e["segment"] for e in entries} == {0}


def test_non_main_rank_writes_nothing(tmp_path):
    job = job_for(tmp_path)
    console = io.StringIO()
    logger = MetricsLogger(job, False, 1e6, 2, stream=console)
    for step in range(1, 7):
        logger.log_step(step, step_values(step))
    logger.log_eval(6, 1.0)
    logger.note("hello")
    logger.close()
    assert not (tmp_path / "run").exists()
    assert console.getvalue() == ""


def test_nan_loss_written_as_null_and_a_later_segment_appends(tmp_path):
    job = job_for(tmp_path, steps=4, interval=1)
    job.logging.tensorboard = False
    console = io.StringIO()
    logger = MetricsLogger(job, True, 1e6, 1, peak=TERA, stream=console)
    for step in range(1, 4):
        value = math.nan if step == 2 else 1.0
        logger.log_step(step, step_values(step, loss=value, grad_norm=value, skipped_steps=int(step >= 2)))
    logger.close()
    entries = read_jsonl(job)
    assert entries[1]["loss"] is None and entries[1]["loss_avg"] is None and entries[1]["skipped_steps"] == 1
    assert console.getvalue().splitlines()[1].split(" | ")[1] == "loss -"  # never "nan"
    first = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    # A later launch resumed from a step-1 checkpoint redoes steps 2.. : it appends, tagged segment 1.
    logger = MetricsLogger(job, True, 1e6, 1, segment=1, peak=TERA, stream=io.StringIO())
    for step in range(2, 5):
        logger.log_step(step, step_values(step, loss=0.5))
    logger.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes().startswith(first)
    rows = read_rows(tmp_path / "run")
    assert [(e["step"], e["segment"]) for e in rows] == [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (4, 1)]
    latest = latest_per_step(rows)
    assert [(e["step"], e["loss"]) for e in latest] == [(1, 1.0), (2, 0.5), (3, 0.5), (4, 0.5)]


def test_nothing_is_created_before_the_first_entry(tmp_path):
    job = job_for(tmp_path)
    logger = MetricsLogger(job, True, 1e6, 1, peak=TERA, stream=io.StringIO())
    logger.log_step(1, step_values(1))  # interval 2: no entry yet
    logger.close()
    assert not (tmp_path / "run").exists()


def test_stopping_writes_the_partial_window(tmp_path):
    job = job_for(tmp_path, steps=10, interval=4)
    job.logging.tensorboard = False
    logger = MetricsLogger(job, True, 1e6, 1, peak=TERA, stream=io.StringIO())
    for step in range(1, 7):
        logger.log_step(step, step_values(step), last=step == 6)
    logger.close()
    entries = read_jsonl(job)
    assert [e["step"] for e in entries] == [4, 6]
    assert entries[1]["loss_avg"] == pytest.approx((4.5 + 4.4) / 2)
    assert logger.last_loss_avg == entries[1]["loss_avg"]


def test_breakdown_is_averaged_per_step(tmp_path):
    job = job_for(tmp_path, steps=2, interval=2)
    job.logging.tensorboard = False
    logger = MetricsLogger(job, True, 1e6, 1, peak=TERA, stream=io.StringIO())
    logger.log_step(1, step_values(1, breakdown={"forward": 0.1, "backward": 0.2}))
    logger.log_step(2, step_values(2, breakdown={"forward": 0.3, "backward": 0.4}))
    logger.close()
    entry = read_jsonl(job)[0]
    assert entry["time_forward_s"] == pytest.approx(0.2) and entry["time_backward_s"] == pytest.approx(0.3)


# --- TensorBoard -----------------------------------------------------------------------------------


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    job = job_for(tmp_path, steps=4, interval=2)
    logger = MetricsLogger(job, True, 1e6, 1, peak=TERA, stream=io.StringIO())
    for step in range(1, 5):
        logger.log_step(step, step_values(step, loss_scale=1024.0, breakdown={"forward": 0.1}))
    logger.log_eval(4, 3.0)
    logger.close()
    accumulator = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/loss_scale",
        "train/skipped_steps",
        "perf/tokens_per_sec",
        "perf/samples_per_sec",
        "perf/step_time_s",
        "perf/data_time_s",
        "perf/tflops_per_device",
        "perf/mfu",
        "perf/peak_memory_gb",
        "eval/loss",
        "time/forward",
    }
    assert expected <= tags
    loss = accumulator.Scalars("train/loss")
    assert [(e.step, round(e.value, 5)) for e in loss] == [(2, 4.8), (4, 4.6)]
    assert [e.value for e in accumulator.Scalars("train/loss_scale")] == [1024.0, 1024.0]
    assert [(e.step, e.value) for e in accumulator.Scalars("eval/loss")] == [(4, 3.0)]
    jsonl = read_jsonl(job)
    assert accumulator.Scalars("perf/mfu")[0].value == pytest.approx(jsonl[0]["mfu"], rel=1e-6)


# --- device peaks ---------------------------------------------------------------------------------


def test_known_gpu_peaks_are_dense_datasheet_figures():
    # NVIDIA datasheets list these with sparsity, rounded to 1 TFLOP/s; the dense figures are half.
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 624 / 2
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", allow_tf32=True) == 312 / 2
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(1979 / 2, abs=0.5)
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "fp16") == pytest.approx(1513 / 2, abs=0.5)
    assert gpu_peak_tflops("NVIDIA H200", "bf16") == pytest.approx(1979 / 2, abs=0.5)
    assert gpu_peak_tflops("NVIDIA H200 NVL", "bf16") == pytest.approx(1671 / 2, abs=0.5)
    assert gpu_peak_tflops("Tesla T4", "fp16") is None


def test_configured_peak_wins_and_bad_precision_is_named():
    assert device_peak("bf16", "cpu", configured_tflops=1.5) == Peak(1.5e12, "logging.peak_tflops")
    with pytest.raises(ValueError, match="precision"):
        device_peak("fp4", "cpu")


def test_cpu_has_no_peak_so_no_mfu(tmp_path):
    """A CPU's peak cannot be stood behind (see llmtrain.training.peak): no MFU unless configured."""
    assert device_peak("bf16", "cpu") is None
    job = job_for(tmp_path, steps=2, interval=2)
    job.logging.tensorboard = False
    console = io.StringIO()
    logger = MetricsLogger(job, True, 1e6, 1, device="cpu", stream=console)
    for step in (1, 2):
        logger.log_step(step, step_values(step))
    logger.close()
    entry = read_jsonl(job)[0]
    assert entry["mfu"] is None and entry["mfu_peak"] is None and entry["tflops_per_device"] > 0
    assert "MFU" not in console.getvalue() and "TFLOP/s/dev" in console.getvalue()


def test_mfu_is_labelled_with_its_peak(tmp_path):
    job = job_for(tmp_path, steps=1, interval=1)
    job.logging.tensorboard = False
    for peak, shown in ((TERA, "MFU 0.8%"), (Peak(1e12, "measured Some GPU"), "MFU 0.8% of measured peak")):
        console = io.StringIO()
        logger = MetricsLogger(job, True, 1e6, 1, peak=peak, stream=console)
        logger.log_step(1, step_values(1, tokens=4000, step_time=0.5))  # 8e9 FLOP/s of 1e12
        logger.close()
        assert f"| {shown} |" in console.getvalue()
        assert read_jsonl(job)[-1]["mfu_peak"] == peak.source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a measured peak is taken on CUDA devices only")
def test_measured_gpu_peak_is_below_the_datasheet():
    """The measured matmul rate of a known GPU stays under its dense datasheet figure (so an MFU against a
    measured peak of an unknown GPU overstates rather than understates it by at most that gap)."""
    name = torch.cuda.get_device_name()
    for precision in ("bf16", "fp16"):
        datasheet = gpu_peak_tflops(name, precision)
        if datasheet is None:
            pytest.skip(f"{name} has no datasheet figure here")
        assert 0 < measured_matmul_tflops(precision, "cuda") <= datasheet


def test_measuring_a_peak_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        measured_matmul_tflops("fp32", "cpu")
