"""tools/calibrate.py: the alpha-beta fit, the profile it writes (every constant sourced, read back by the
planner, reproducing the measured all-reduce), and one quick run end to end."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.planner.calibration import compute
from llmtrain.planner.calibration.links import LinkFit
from llmtrain.planner.calibration.measurements import Measurements, profile_of
from llmtrain.planner.calibration.timing import fit_alpha_beta, least_disturbed, monotone_times
from llmtrain.planner.cluster.files import cluster_from_dict, load_cluster
from llmtrain.planner.cluster.interpolate import rate_at, time_at

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):  # noqa: ANN202 (a module)
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measurements() -> Measurements:
    """A made-up CPU calibration: 2 processes, all-reduce of 2 ranks at 50 us + bytes / 1 GB/s."""
    points = tuple((n, 50e-6 + n / 1e9) for n in (2**12, 2**16, 2**20))
    return Measurements(
        device="cpu-8-cores",
        device_kind="cpu",
        devices=2,
        memory_gb=16.0,
        gemm_tflops={"fp32": {"512x512x512": 0.2, "1024x1024x1024": 0.4}, "bf16": {"512x512x512": 0.1}},
        attention_tflops=0.1,
        memory_bandwidth_gbs=20.0,
        launch_us=3.0,
        host_bandwidth_gbs=20.0,
        host_adam_gparams=0.05,
        links=[LinkFit("gloo", "all_reduce", 2, 50e-6, 1e9, points)],
    )


def test_alpha_beta_fit_recovers_a_line_and_needs_two_sizes():
    alpha, bandwidth = fit_alpha_beta([(n, 20e-6 + n / 5e9) for n in (1000, 10**6, 10**7)])
    assert alpha == pytest.approx(20e-6) and bandwidth == pytest.approx(5e9)
    with pytest.raises(ValueError, match="at least 2 message sizes"):
        fit_alpha_beta([(1000, 1.0)])


def test_the_profile_names_this_run_for_every_constant_and_reproduces_the_all_reduce():
    profile = profile_of(_measurements(), when="2026-01-01 00:00 UTC")
    cluster = cluster_from_dict(profile, "calibrated.yaml")
    assert cluster.unsourced() == []
    measured = [k for k, v in cluster.sources.items() if v.startswith("calibration run")]
    assert "devices.cpu-8-cores.peak_tflops" in measured and "links.intra_node.latency_us" in measured
    view = cluster.view(2)
    # Two processes share the CPU: each gets half the best matmul rate and half the copy bandwidth.
    assert view.device.peak_tflops["fp32"] == pytest.approx(0.2)
    assert view.device.memory_bandwidth_gbs == pytest.approx(10.0)
    for nbytes in (2**12, 2**20):
        assert view.all_reduce(nbytes, 2) == pytest.approx(50e-6 + nbytes / 1e9)


def test_the_measured_tables_reach_the_cost_model_with_their_sources():
    m = _measurements()
    m.gemm_table = {"fp32": [[1e6, 0.05], [1e9, 0.2]]}
    m.host_op_us = 4.0
    m.fresh_page_gbs = 3.0
    m.memory_table = {"elementwise": [[2**16, 20.0], [2**22, 8.0]], "softmax": [[2**20, 5.0]]}
    m.links.append(LinkFit("nccl", "all_reduce", 2, 1e-6, 1e11, ((2**12, 1e-5), (2**20, 2e-5))))
    m.links[0] = replace(m.links[0], fsdp_call_s=300e-6, after_compute_s=100e-6)
    profile = profile_of(m, when="2026-01-01 00:00 UTC")
    cluster = cluster_from_dict(profile, "calibrated.yaml")
    assert cluster.unsourced() == []
    assert {"devices.cpu-8-cores.gemm_table", "links.intra_node.measured"} <= set(cluster.sources)
    device = cluster.view(2).device
    # Measured per process: the table is not divided between the processes as the peak is.
    assert device.gemm_time(100, 100, 100, "fp32") == pytest.approx(
        2e6 / (rate_at(m.gemm_table["fp32"], 2e6) * 1e12)
    )
    assert device.host_op_us == 4.0 and device.host_is_device and device.fsdp_call_us == 300.0
    assert device.fresh_page_gbs == 3.0 and device.memory_table == m.memory_table
    assert {"devices.cpu-8-cores.memory_table", "devices.cpu-8-cores.fresh_page_gbs"} <= set(cluster.sources)
    # A CPU's trainer runs gloo: the gloo points interpolated (not nccl's), plus the after-compute cost.
    assert cluster.view(2).all_reduce(2**16, 2) == pytest.approx(
        time_at([[float(n), t] for n, t in m.links[0].points], 2**16) + 100e-6
    )


def test_calibrate_refuses_to_replace_a_file_and_bad_group_sizes(tmp_path):
    calibrate = _tool("calibrate")
    existing = tmp_path / "c.yaml"
    existing.write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        calibrate.main(["--output", str(existing)])
    with pytest.raises(ConfigError, match="--group-sizes entry at least 2"):
        calibrate.main(["--output", str(tmp_path / "d.yaml"), "--group-sizes", "1"])


@pytest.mark.slow  # gloo groups of 2 processes
def test_a_quick_calibration_is_a_cluster_the_planner_plans_on(tmp_path, capsys, monkeypatch):
    # What this checks is the tool's path end to end: every quantity measured, sourced, written and read
    # back into a cluster the planner plans on; not the numbers (nor could it on a shared machine), which
    # no shape or repeat count below changes the path to. Measured on this 2-core CPU without bf16 units:
    # bf16 matmuls run at 1.3 GFLOP/s a core (fp32 27), so the table's width 256 alone (7 GFLOP a run, 18
    # runs) cost ~100 CPU seconds. So: smaller matmuls, two table widths (an interpolated table's fewest),
    # one round of one timed run, and cold operands of 4 MiB instead of 64 (fewer copies to fill).
    monkeypatch.setattr(compute, "GEMM_SHAPES_CPU", ((256, 256, 256), (512, 128, 512)))
    monkeypatch.setattr(compute, "TABLE_WIDTHS_CPU", (32, 64))
    monkeypatch.setattr(compute, "TABLE_ROUNDS", 1)
    monkeypatch.setattr(compute, "TABLE_ROUND_RUNS", 1)
    monkeypatch.setattr(compute, "MEMORY_RUNS", 1)
    monkeypatch.setattr(compute, "COLD_BYTES", 4 * 2**20)
    out = tmp_path / "calibrated.yaml"
    assert _tool("calibrate").main(["--output", str(out), "--quick", "--group-sizes", "2"]) == 0
    cluster = load_cluster(out)
    assert cluster.unsourced() == [] and cluster.view(2).intra.bandwidth_gbs > 0
    plan = _tool("plan")
    config = str(REPO / "configs/llama-small.yaml")
    assert plan.main(["--config", config, "--cluster", str(out), "--gpus", "2", "--json", "--top", "1"]) == 0
    printed = capsys.readouterr().out
    best = json.loads(printed[printed.index("\n{") + 1 :])["layouts"][0]
    assert best["step_time_s"] > 0 and best["tp"] * best["pp"] * best["dp"] == 2


def test_the_least_disturbed_round_counts_and_a_smaller_message_never_costs_more():
    assert least_disturbed([3e-3, 1e-3, 2e-3]) == 1e-3
    with pytest.raises(ValueError, match="at least one round"):
        least_disturbed([])
    # A disturbed first size (set-up, load) is capped by the larger sizes' times; the rest stays as measured.
    measured = [(8192, 2.6e-4), (1024, 3.9e-3), (65536, 4e-4), (524288, 6.7e-4)]
    assert monotone_times(measured) == [(1024, 2.6e-4), (8192, 2.6e-4), (65536, 4e-4), (524288, 6.7e-4)]


def test_attention_efficiency_is_over_the_peak_of_the_dtype_it_was_timed_in():
    m = _measurements()
    m.gemm_tflops["bf16"] = {"512x512x512": 2.0}  # a CPU's bf16 matmuls (AMX) far faster than its fp32 ones
    device = profile_of(m, when="2026-01-01 00:00 UTC")["devices"]["cpu-8-cores"]
    # Timed in fp32 on one process's share: 0.1 TFLOP/s over the per-process fp32 peak 0.4 / 2.
    assert device["attention_efficiency"] == pytest.approx(0.5)
