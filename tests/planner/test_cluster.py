"""Cluster files and the alpha-beta collective costs, against hand-computed cases."""

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.planner.cluster.files import cluster_from_dict, cluster_to_dict, load_cluster
from llmtrain.planner.cluster.hardware import FRESH_PAGE_BYTES


def tiny(**links):
    return {
        "devices": {
            "fast": {"peak_tflops": {"bf16": 100.0}, "memory_gb": 80, "memory_bandwidth_gbs": 2000},
            "slow": {"peak_tflops": {"bf16": 50.0}, "memory_gb": 40, "memory_bandwidth_gbs": 1000},
        },
        "nodes": [
            {"count": 2, "devices_per_node": 4, "device": "fast", "intra_link": "nvlink"},
            {"count": 2, "devices_per_node": 4, "device": "slow", "intra_link": "nvlink"},
        ],
        "links": {
            "nvlink": {"bandwidth_gbs": 100, "latency_us": 1, "efficiency": 1.0},
            "inter_node": {"bandwidth_gbs": 10, "latency_us": 10, "efficiency": 1.0},
            **links,
        },
    }


def test_presets_load_with_dense_peaks():
    a100 = load_cluster("a100-80gb")
    dev = a100.view(8).device
    assert dev.peak_tflops["bf16"] == 312.0  # dense, not the 624 sparse figure
    assert a100.nodes[0].devices_per_node == 8 and a100.num_devices >= 3072
    assert load_cluster("h100-80gb").view(8).device.peak_tflops["bf16"] == pytest.approx(989.4)


def test_ring_all_reduce_inside_a_node():
    view = cluster_from_dict(tiny()).view(4)
    n, size = 4, 1e9
    ring = 2 * (n - 1) / n * size / 100e9 + 2 * (n - 1) * 1e-6
    assert view.all_reduce(size, n) == pytest.approx(ring)
    assert view.all_gather(size, n) == pytest.approx((n - 1) / n * size / 100e9 + (n - 1) * 1e-6)
    assert view.all_reduce(size, 1) == 0.0


def test_groups_spanning_nodes_use_one_nic_per_member_per_node():
    view = cluster_from_dict(tiny()).view(16)
    # dp group of 4 with stride 4 (tp=4 inside each node): one member per node, one 10 GB/s NIC.
    assert view.members_per_node(4, 4) == 1 and view.spans_nodes(4, 4)
    ring = 2 * 3 / 4 * 1e9 / 10e9 + 2 * 3 * 10e-6
    assert view.all_reduce(1e9, 4, stride=4) == pytest.approx(ring)
    # group of 8 with stride 1: 4 members per node drive 4 NICs.
    assert view.all_reduce(1e9, 8, stride=1) == pytest.approx(2 * 7 / 8 * 1e9 / 40e9 + 2 * 7 * 10e-6)
    # Small messages: the tree's log2(n) latency beats the ring's n.
    assert view.all_reduce(8, 16) == pytest.approx(2 * 8 / 40e9 + 2 * 4 * 10e-6)


def test_heterogeneous_cluster_runs_at_the_slowest_device():
    cl = cluster_from_dict(tiny())
    assert cl.view(8).device.peak_tflops["bf16"] == 100.0  # first two nodes only
    mixed = cl.view(12).device
    assert mixed.peak_tflops["bf16"] == 50.0 and mixed.memory_gb == 40


def test_efficiency_curve_grows_with_matmul_size():
    dev = load_cluster("a100-80gb").view(8).device
    small, mid, big = (dev.gemm_efficiency_at(n, n, n) for n in (256, 1024, 8192))
    assert small < mid < big <= dev.gemm_efficiency


def test_memory_bound_kernels_run_at_the_rate_measured_at_their_tensor_size():
    raw = tiny()
    table = {"elementwise": [[2**16, 40.0], [2**22, 10.0]], "softmax": [[2**20, 5.0]]}
    raw["devices"]["fast"]["memory_table"] = table
    dev = cluster_from_dict(raw).view(4).device
    # Cache-sized tensors at the first rate, large ones at the last, between them linear in log(bytes).
    assert dev.memory_time(1e6, kernels=3, tensor_bytes=2**14) == pytest.approx(1e6 / 40e9)
    assert dev.memory_time(1e6, kernels=3, tensor_bytes=2**24) == pytest.approx(1e6 / 10e9)
    assert dev.memory_time(1e6, tensor_bytes=2**19) == pytest.approx(1e6 / 25e9)
    assert dev.memory_time(1e6, tensor_bytes=2**19, kind="softmax") == pytest.approx(1e6 / 5e9)
    # Tensor size not known: the bandwidth and the per-kernel overhead.
    assert dev.memory_time(1e6, kernels=3) == pytest.approx(1e6 / (2000e9 * 0.8) + 3 * 4e-6)


def test_only_tensors_the_allocator_maps_fresh_pay_for_their_pages():
    raw = tiny()
    raw["devices"]["fast"]["fresh_page_gbs"] = 4.0
    dev = cluster_from_dict(raw).view(4).device
    assert dev.fresh_time(FRESH_PAGE_BYTES - 1) == 0.0
    assert dev.fresh_time(2 * FRESH_PAGE_BYTES) == pytest.approx(2 * FRESH_PAGE_BYTES / 4e9)
    assert cluster_from_dict(tiny()).view(4).device.fresh_time(2 * FRESH_PAGE_BYTES) == 0.0  # not measured


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d["nodes"][0].update(device="tpu"), "nodes[0].device"),
        (lambda d: d["devices"]["fast"].update(memory_gb=-1), "memory_gb"),
        (lambda d: d["devices"]["fast"].update(colour="red"), "colour"),
        (lambda d: d["links"].pop("inter_node"), "inter_node"),
        (lambda d: d["devices"]["fast"].update(memory_table={"gemm": [[1, 1]]}), "memory_table must map"),
        (lambda d: d["devices"]["fast"].update(memory_table={"softmax": [[1, -2]]}), "memory_table.softmax"),
    ],
)
def test_bad_cluster_files_name_the_field(mutate, needle):
    raw = tiny()
    mutate(raw)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        cluster_from_dict(raw)


def test_too_many_gpus_is_a_clear_error_only_for_mixed_node_types():
    with pytest.raises(ConfigError, match="--gpus"):
        cluster_from_dict(tiny()).view(100)
    # One node type: any count (6,144 H100s against the 4,096 of the preset's file: 768 nodes).
    h100 = load_cluster("h100-80gb")
    assert h100.num_devices == 4096
    view = h100.view(6144)
    assert view.devices == 6144 and view.devices_per_node == 8
    assert view.spans_nodes(768, 8) and not view.spans_nodes(8, 1)


def test_cluster_dict_round_trip():
    for cl in (load_cluster("a100-80gb"), cluster_from_dict(tiny())):
        assert cluster_from_dict(cluster_to_dict(cl)) == cl


def test_sources_must_name_constants_of_the_cluster_and_be_text():
    raw = cluster_to_dict(load_cluster("a100-80gb"))
    assert load_cluster("a100-80gb").sources == cluster_from_dict(raw).sources  # round trip
    raw["sources"] = {"devices.a100-sxm4-80gb.gemm_eficiency": "typo"}
    with pytest.raises(ConfigError, match="sources.devices.a100-sxm4-80gb.gemm_eficiency names no constant"):
        cluster_from_dict(raw)
    raw["sources"] = {"links.intra_node.latency_us": ""}
    with pytest.raises(ConfigError, match="sources.links.intra_node.latency_us must be a citation string"):
        cluster_from_dict(raw)
    raw["sources"] = {"links.intra_node.latency_us": "vendor specification"}
    unsourced = cluster_from_dict(raw).unsourced()
    assert "links.intra_node.latency_us" not in unsourced
    assert "devices.a100-sxm4-80gb.gemm_efficiency" in unsourced


@pytest.mark.parametrize(
    "name,gib,preset",
    [
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", 79.1, "h100-80gb"),
        ("NVIDIA H200", 139.8, "h200-141gb"),
        ("NVIDIA L4", 22.0, None),
    ],
)
def test_local_gpus_map_to_their_preset_by_name_and_memory(name, gib, preset):
    from llmtrain.planner.calibration.profile import preset_for

    assert preset_for(name, gib) == preset
    if preset:
        assert load_cluster(preset).view(8).device.memory_gb == pytest.approx(gib, abs=2.0)


@pytest.mark.slow  # multi-second (6 s on two idle cores): runs in CI, not in -m 'not slow'
def test_an_unknown_device_is_described_per_node_across_nodes(monkeypatch):
    # CPU here: no preset. Under torchrun on 2 nodes of 2 processes each, one node is described and the
    # 4-process job spans two of them.
    from llmtrain.planner.calibration.profile import local_cluster

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    local_cluster.cache_clear()
    try:
        view = local_cluster(4).view(4)
    finally:
        local_cluster.cache_clear()
    assert view.devices_per_node == 2 and view.spans_nodes(4) and not view.spans_nodes(2)
