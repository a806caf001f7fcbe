"""The calibrated tables' interpolation (llmtrain.planner.interpolate) and how the cluster reads the tables:
measured matmul rates and collective times replace the formulas where given, and only there."""

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.planner.cluster.files import cluster_from_dict, load_cluster
from llmtrain.planner.cluster.interpolate import rate_at, time_at

RATES = [[1e6, 0.05], [1e8, 0.15], [1e10, 0.2]]


def test_matmul_rate_is_linear_in_log_flops_and_flat_outside_the_table():
    assert rate_at(RATES, 1e8) == 0.15  # a measured point is returned as measured
    assert rate_at(RATES, 1e7) == pytest.approx(0.10)  # half-way in log(FLOPs) between 1e6 and 1e8
    assert rate_at(RATES, 1e9) == pytest.approx(0.175)
    assert rate_at(RATES, 10.0) == 0.05 and rate_at(RATES, 1e13) == 0.2
    assert rate_at([[1e8, 0.1], [1e8, 0.3], [1e6, 0.1]], 1e8) == pytest.approx(0.2)  # repeats averaged


def test_collective_time_follows_a_power_law_between_points_and_the_last_bandwidth_beyond():
    # A linear stretch (time = bytes / 1 GB/s) over a 16x gap: log-log interpolation stays on it.
    line = [[2.0**16, 2.0**16 / 1e9], [2.0**20, 2.0**20 / 1e9]]
    assert time_at(line, 2.0**18) == pytest.approx(2.0**18 / 1e9)
    # Between a latency floor and a bandwidth regime: the geometric mean half-way in log(bytes).
    points = [[1e3, 100e-6], [1e5, 400e-6], [1e7, 10.4e-3]]
    assert time_at(points, 1e4) == pytest.approx(200e-6)
    assert time_at(points, 10.0) == 100e-6  # the floor below the smallest size
    slope = (10.4e-3 - 400e-6) / (1e7 - 1e5)
    assert time_at(points, 3e7) == pytest.approx(10.4e-3 + slope * 2e7)


@pytest.mark.parametrize("table", [[], [[0, 1.0]], [[-5, 1.0]]])
def test_empty_tables_and_non_positive_sizes_are_refused(table):
    with pytest.raises(ValueError):
        rate_at(table, 1e6)


def _cpu(**device) -> dict:
    link = {"bandwidth_gbs": 1.0, "latency_us": 50.0, "efficiency": 1.0}
    return {
        "devices": {
            "cpu": {"peak_tflops": {"fp32": 0.2}, "memory_gb": 8, "memory_bandwidth_gbs": 10, **device}
        },
        "nodes": [{"count": 1, "devices_per_node": 2, "device": "cpu", "intra_link": "intra_node"}],
        "links": {"intra_node": dict(link), "inter_node": dict(link)},
    }


def test_a_device_with_a_matmul_table_times_matmuls_at_the_measured_rate():
    plain = cluster_from_dict(_cpu()).view(2).device
    tabled = cluster_from_dict(_cpu(gemm_table={"fp32": RATES})).view(2).device
    m = n = k = 100.0  # 2e6 FLOPs: between the first two points
    expected = 2e6 / (rate_at(RATES, 2e6) * 1e12)
    assert tabled.gemm_time(m, n, k, "fp32") == pytest.approx(expected)
    assert plain.gemm_time(m, n, k, "fp32") != pytest.approx(expected)
    # bf16 falls back to nothing measured: the roofline, as without a table.
    both = cluster_from_dict(_cpu(peak_tflops={"fp32": 0.2, "bf16": 1.0}, gemm_table={"fp32": RATES}))
    roof = cluster_from_dict(_cpu(peak_tflops={"fp32": 0.2, "bf16": 1.0}))
    assert both.view(2).device.gemm_time(m, n, k, "bf16") == roof.view(2).device.gemm_time(m, n, k, "bf16")


def test_measured_collectives_replace_the_formula_only_for_the_measured_group_inside_a_node():
    raw = _cpu()
    points = [[1e3, 300e-6], [1e6, 1.3e-3]]
    raw["links"]["intra_node"]["measured"] = {"all_gather": {2: points}, "send": {2: points}}
    view = cluster_from_dict(raw).view(2)
    assert view.all_gather(1e6, 2) == pytest.approx(1.3e-3)
    assert view.all_gather(1e3, 2) == pytest.approx(300e-6)
    assert view.p2p(1e3, cross_node=False) == pytest.approx(300e-6)
    # Not measured: reduce-scatter and the all-reduce keep the alpha-beta formulas.
    assert view.reduce_scatter(1e6, 2) == pytest.approx(0.5 * 1e6 / 1e9 + 50e-6)
    assert view.all_reduce(1e6, 2) == pytest.approx(1e6 / 1e9 + 2 * 50e-6)
    # A group spanning nodes (4 ranks, 2 per node) runs on the inter-node link: the formula.
    assert view.p2p(1e3, cross_node=True) == pytest.approx(1e3 / 1e9 + 50e-6)
    wide = cluster_from_dict(raw).view(4)
    assert wide.spans_nodes(2, 2) and wide.all_gather(1e6, 2, stride=2) == pytest.approx(0.5e-3 + 50e-6)


def test_the_after_compute_cost_joins_every_measured_collective_and_send_but_not_the_formulas():
    raw = _cpu()
    points = [[1e3, 300e-6], [1e6, 1.3e-3]]
    raw["links"]["intra_node"].update(
        measured={"all_reduce": {2: points}, "send": {2: points}}, after_compute_us=200.0
    )
    view = cluster_from_dict(raw).view(2)
    assert view.all_reduce(1e6, 2) == pytest.approx(1.3e-3 + 200e-6)
    assert view.p2p(1e3, cross_node=False) == pytest.approx(300e-6 + 200e-6)
    assert view.all_gather(1e6, 2) == pytest.approx(0.5 * 1e6 / 1e9 + 50e-6)


def test_measured_only_fields_are_constants_only_where_set():
    assert not any(
        name.endswith((".gemm_table", ".host_op_us", ".host_is_device", ".fsdp_call_us", ".measured"))
        for name in load_cluster("a100-80gb").constants()
    )
    raw = _cpu(gemm_table={"fp32": RATES}, host_op_us=5.0)
    raw["links"]["intra_node"]["measured"] = {"all_reduce": {2: [[1e3, 1e-4]]}}
    names = cluster_from_dict(raw).constants()
    for name in ("gemm_table", "host_op_us", "host_is_device"):
        assert f"devices.cpu.{name}" in names
    assert "links.intra_node.measured" in names and "links.inter_node.measured" not in names


@pytest.mark.parametrize(
    "device, measured, needle",
    [
        ({"gemm_table": {"fp32": [[1e6]]}}, None, "gemm_table.fp32: each entry must be a"),
        ({"gemm_table": {"fp32": [[1e6, -1.0]]}}, None, "gemm_table.fp32 must be a positive number"),
        ({}, {"broadcast": {2: [[1, 1]]}}, "measured.broadcast: measured operations are"),
        ({}, {"send": {1: [[1, 1]]}}, "group sizes must be integers >= 2"),
        ({}, {"send": {2: []}}, "measured.send.2 must be a non-empty list"),
    ],
)
def test_bad_tables_name_the_field(device, measured, needle):
    raw = _cpu(**device)
    if measured:
        raw["links"]["intra_node"]["measured"] = measured
    with pytest.raises(ConfigError, match=needle):
        cluster_from_dict(raw)
