"""The local (this machine) validation's pieces: rank correlation, metrics parsing, run overrides, table.

References: the worked example of Wikipedia's "Spearman's rank correlation coefficient" article, pandas'
Spearman correlation (tie-averaged ranks), hand-computed relative errors, the config loader for the run
overrides, the cost model for the fixed-layout prediction and a cluster file as tools/calibrate.py writes it.
No training runs here.
"""

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest

from llmtrain.config import load
from llmtrain.config.validate import validate_world
from llmtrain.planner import CostModel, Workload, cluster_from_dict
from llmtrain.planner.calibration.measurements import profile_of
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cost.layout import Layout, Software
from llmtrain.planner.report.files import write_yaml
from llmtrain.planner.validation.local import (
    ERROR_TARGET,
    LOCAL_CONFIG,
    LOCAL_LAYOUTS,
    LOCAL_MODEL_OVERRIDES,
    LocalPoint,
    format_local,
    local_summary,
    median_step_time,
    predict,
    run_overrides,
    spearman,
)
from tests.planner.test_calibration import _measurements

REPO = Path(__file__).resolve().parents[2]


def test_spearman_matches_the_published_worked_example():
    iq = [106, 100, 86, 101, 99, 103, 97, 113, 112, 110]
    tv_hours = [7, 27, 2, 50, 28, 29, 20, 12, 6, 17]
    assert spearman(iq, tv_hours) == pytest.approx(-29 / 165)  # sum d^2 = 194: 1 - 6*194/(10*99)


def test_spearman_without_ties_is_the_d_squared_formula_and_rank_only():
    rng = random.Random(0)
    xs = [rng.random() for _ in range(12)]
    ys = [rng.random() for _ in range(12)]
    rank = {v: i for i, v in enumerate(sorted(xs))}, {v: i for i, v in enumerate(sorted(ys))}
    d2 = sum((rank[0][x] - rank[1][y]) ** 2 for x, y in zip(xs, ys, strict=True))
    n = len(xs)
    assert spearman(xs, ys) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
    assert spearman(xs, [math.exp(3 * x) for x in xs]) == pytest.approx(1.0)  # monotone: only order counts
    assert spearman(xs, [-x for x in xs]) == pytest.approx(-1.0)


def test_spearman_with_ties_matches_pandas():
    pd = pytest.importorskip("pandas")
    xs = [1.0, 2.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.5]
    ys = [0.3, 0.1, 0.4, 0.4, 0.9, 0.2, 0.9, 0.0]
    # Spearman with ties = Pearson of the average ranks (pandas' Spearman itself needs scipy).
    expected = pd.Series(xs).rank(method="average").corr(pd.Series(ys).rank(method="average"))
    assert spearman(xs, ys) == pytest.approx(expected)


def test_spearman_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2"):
        spearman([1], [1])
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # undefined when one side has no spread


def test_median_step_time_skips_warmup_and_eval_entries():
    lines = [json.dumps({"step": s, "step_time_s": t}) for s, t in [(1, 9.0), (2, 5.0), (3, 0.3), (4, 0.1)]]
    lines.insert(2, json.dumps({"step": 2, "eval_loss": 4.0}))
    lines += [json.dumps({"step": 5, "step_time_s": 0.2}), ""]
    assert median_step_time(lines, warmup=2) == pytest.approx(0.2)
    assert median_step_time(lines, warmup=0) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="warm-up"):
        median_step_time(lines, warmup=5)


@pytest.mark.parametrize("layout", LOCAL_LAYOUTS, ids=lambda lay: lay.short())
def test_run_overrides_load_as_exactly_the_layout(layout, tmp_path):
    job = load(REPO / LOCAL_CONFIG, [*LOCAL_MODEL_OVERRIDES, *run_overrides(layout, 6, str(tmp_path))])
    assert validate_world(job, layout.gpus) == layout.dp
    p, t = job.parallel, job.train
    got = Layout(p.tp, p.pp, p.dp, t.micro_batch_size, p.virtual_stages, p.schedule, job.model.recompute,
                 p.sequence_parallel, p.zero_stage)  # fmt: skip
    assert got == layout
    assert (t.steps, t.num_threads, job.logging.interval, job.output_dir) == (6, 1, 1, str(tmp_path))


def test_local_layouts_cover_every_layout_kind_with_enough_points():
    kinds = {(lay.tp, lay.pp, lay.dp) for lay in LOCAL_LAYOUTS}
    assert kinds == {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert len(set(LOCAL_LAYOUTS)) == len(LOCAL_LAYOUTS) >= 10  # issue 19: at least ten layouts
    assert {lay.zero_stage for lay in LOCAL_LAYOUTS} == {0, 1, 2, 3}
    assert {lay.recompute for lay in LOCAL_LAYOUTS} == {"none", "selective", "full"}
    assert any(lay.sequence_parallel for lay in LOCAL_LAYOUTS)


def local_like_cluster():
    """A cluster file shaped like tools/plan.py --profile-local's (CPU figures)."""
    return cluster_from_dict({
        "devices": {"cpu": {"peak_tflops": {"fp32": 0.05, "bf16": 0.01}, "memory_gb": 8,
                            "memory_bandwidth_gbs": 5, "gemm_efficiency": 1.0, "memory_efficiency": 1.0,
                            "attention_efficiency": 0.5, "kernel_overhead_us": 10.0, "reserved_gb": 0.5}},
        "nodes": [{"count": 1, "devices_per_node": 2, "device": "cpu", "intra_link": "loop"}],
        "links": {"loop": {"bandwidth_gbs": 2, "latency_us": 60, "efficiency": 1.0},
                  "inter_node": {"bandwidth_gbs": 2, "latency_us": 60, "efficiency": 1.0}},
    })  # fmt: skip


def test_prediction_is_the_cost_model_of_exactly_that_layout():
    workload = Workload.from_job(load(REPO / LOCAL_CONFIG, list(LOCAL_MODEL_OVERRIDES)))
    cluster = local_like_cluster()
    for layout in LOCAL_LAYOUTS:
        est = predict(workload, cluster, layout)
        assert est.layout == layout
        # The CPU runs PyTorch's reference ops: the software the prediction describes.
        model = CostModel(workload, cluster.view(layout.gpus), Software(fused_kernels=False))
        direct = model.evaluate(layout, use_simulator=True)
        assert est.step_time == pytest.approx(direct.step_time)


def test_a_calibration_file_is_the_cluster_the_predictions_use(tmp_path):
    path = tmp_path / "local.yaml"
    write_yaml(profile_of(_measurements(), when="2026-01-01 00:00 UTC"), path)
    cluster = load_cluster(path)
    workload = Workload.from_job(load(REPO / LOCAL_CONFIG, list(LOCAL_MODEL_OVERRIDES)))
    times = [predict(workload, cluster, layout).step_time for layout in LOCAL_LAYOUTS]
    assert all(t > 0 and math.isfinite(t) for t in times)


def test_error_is_relative_to_the_measurement():
    assert LocalPoint(LOCAL_LAYOUTS[0], 1.0, 2.0).error == pytest.approx(0.5)  # under by half the measurement
    assert LocalPoint(LOCAL_LAYOUTS[0], 3.0, 2.0).error == pytest.approx(0.5)  # over by as much
    assert LocalPoint(LOCAL_LAYOUTS[0], 2.0, 2.0).error == 0.0


def test_table_lists_every_layout_and_the_summary():
    layouts = LOCAL_LAYOUTS[:4]
    points = [LocalPoint(lay, p, m) for lay, p, m in zip(layouts, [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 9.0, 8.0],
                                                          strict=True)]  # fmt: skip
    table = format_local(points)
    lines = table.splitlines()
    assert len(lines) == 1 + len(points) + 2
    for line, point in zip(lines[1:-2], points, strict=True):
        assert point.layout.short() in line
        assert line.split()[-4:] == [f"{point.predicted:.4f}", f"{point.measured:.4f}", f"{point.ratio:.2f}",
                                     f"{100 * point.error:.1f}%"]  # fmt: skip
    s = local_summary(points)
    assert s["spearman"] == pytest.approx(0.8)  # one swapped pair of 4: 1 - 6*2/(4*15)
    assert (s["median_ratio"], s["min_ratio"], s["max_ratio"]) == pytest.approx((2.0, 1.5, 3.0))
    # Errors 1/2, 1/3, 2/3, 1/2: median 1/2, max 2/3.
    assert (s["median_error"], s["max_error"]) == pytest.approx((0.5, 2 / 3))
    assert "median 50.0%, max 66.7% (misses the median <= 15% target)" in lines[-2]
    assert "Spearman rank correlation +0.800 over 4 layouts" in lines[-1]
    close = [LocalPoint(lay, p.measured * 1.1, p.measured) for lay, p in zip(layouts, points, strict=True)]
    assert s["median_error"] > ERROR_TARGET >= local_summary(close)["median_error"]
    assert "(meets the median <= 15% target)" in format_local(close)


@pytest.mark.slow  # multi-second (3 s on two idle cores): runs in CI, not in -m 'not slow'
def test_a_bad_local_cluster_fails_before_any_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("validate_planner", REPO / "benchmarks/validate_planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    missing = str(tmp_path / "local.yaml")
    assert bench.main(["--local", "--local-cluster", missing]) == 2
    assert f"cluster file {missing} does not exist" in capsys.readouterr().err
