"""Heterogeneous clusters (llmtrain.planner.hetero) on the shipped mixed-h100-a100 file: the uneven splits
are the best by brute force over every split, the plan's pipeline time is the pipeline simulator's replay
of the per-stage costs, and tools/plan.py --write gives a config the trainer accepts."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

from llmtrain.config import load, validate_world
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.planner import load_cluster
from llmtrain.planner.cost.layout import Layout, Workload
from llmtrain.planner.search.hetero import HeteroPlanner, rank_devices

ROOT = Path(__file__).resolve().parents[2]
GPUS = 32
H100, A100 = "h100-sxm5-80gb", "a100-sxm4-80gb"


def _job(global_batch: int = 64):
    overrides = [
        "model.arch=llama",
        "model.num_layers=12",
        "model.hidden_size=2048",
        "model.num_attention_heads=16",
        "model.num_kv_heads=4",
        "model.vocab_size=32000",
        "model.seq_length=2048",
        f"train.global_batch_size={global_batch}",
        "train.micro_batch_size=1",
        "train.precision=bf16",
    ]
    return load(None, overrides)


def _planner(job) -> HeteroPlanner:
    return HeteroPlanner(Workload.from_job(job), load_cluster("mixed-h100-a100"), GPUS)


def test_the_mixed_cluster_loads_as_two_node_kinds_in_file_order():
    cluster = load_cluster("mixed-h100-a100")
    assert [(g.count, g.devices_per_node, g.device.name) for g in cluster.nodes] == [
        (2, 8, H100),
        (2, 8, A100),
    ]
    assert [d.name for d in rank_devices(cluster, GPUS)] == [H100] * 16 + [A100] * 16
    assert cluster.view(GPUS).device.name == A100  # the homogeneous search plans on the slowest
    assert not cluster.unsourced()


def test_pipeline_stages_get_layers_by_speed_and_the_simulator_confirms_the_time():
    job = _job()
    planner = _planner(job)
    layout = Layout(tp=4, pp=2, dp=4, micro_batch=1)
    plan = planner.plan(layout, job)
    assert plan is not None and plan.devices == (H100, A100)
    layers = plan.layout.stage_layers
    assert sum(layers) == 12 and layers[0] > layers[1]  # the H100 stage holds more
    devices = [planner.devices[0], planner.devices[-1]]

    def stage_times(split: tuple[int, ...]) -> tuple[list[float], ...]:
        return planner._stage_costs(Layout(tp=4, pp=2, dp=4, micro_batch=1, stage_layers=split), devices)

    def slowest_stage(split: tuple[int, ...]) -> float:
        fwd, bwd, _ = stage_times(split)
        return max(f + b for f, b in zip(fwd, bwd, strict=True))

    brute = min(slowest_stage((n, 12 - n)) for n in range(1, 12))
    assert slowest_stage(layers) == brute
    # The pipeline simulator, run here on the plan's per-stage costs, gives the plan's pipeline time.
    fwd, bwd, wgt = stage_times(layers)
    micro = 64 // 4
    table = lambda costs: [[c] for c in costs]  # noqa: E731 - one chunk per rank
    p2p = planner.slowest.p2p_time(layout)
    replay = simulate(build_schedule("1f1b", 2, micro, 1), table(fwd), table(bwd), table(wgt), p2p).step_time
    rest = plan.estimate.dp_exposed + plan.estimate.optimizer
    assert abs(plan.step_time - rest - replay) <= 1e-12 * replay
    # The closed form the search uses is exact for equal stages only; for unequal ones it orders fill and
    # drain differently, by at most one stage's forward + backward per extra stage (measured: 1.8% here).
    assert abs(plan.closed_form_step_time - plan.step_time) <= (2 - 1) * slowest_stage(layers)
    # The even split is the trainer's own without parallel.stage_layers (balanced by FLOPs, head on the last).
    even = stage_times(planner.slowest.chunk_layers(layout))
    even_replay = simulate(build_schedule("1f1b", 2, micro, 1), *map(table, even), p2p).step_time
    assert abs(plan.even_step_time - rest - even_replay) <= 1e-12 * even_replay
    assert plan.gain > 1.1  # measured 1.15: the A100 stage also holds the output layer


def test_replicas_get_micro_batches_by_speed_the_best_split_by_brute_force():
    job = _job(global_batch=16)
    planner = _planner(job)
    layout = Layout(tp=8, pp=1, dp=4, micro_batch=1)
    plan = planner.plan(layout, job)
    assert plan is not None and plan.devices == (H100, H100, A100, A100)
    counts = plan.dp_micro_batches
    per_micro = [
        sum(planner.model_of(d).rank_costs(layout)[i][0] for i in (0, 1))
        for d in planner._part_devices(layout)
    ]
    step = lambda split: max(n * t for n, t in zip(split, per_micro, strict=True))  # noqa: E731
    splits = [s for s in itertools.product(range(1, 14), repeat=4) if sum(s) == 16]
    assert sum(counts) == 16 and step(counts) == min(map(step, splits))
    assert counts[0] > counts[-1]
    rest = plan.estimate.dp_exposed + plan.estimate.optimizer
    assert abs(plan.step_time - rest - step(counts)) <= 1e-12 * plan.step_time
    assert abs(plan.even_step_time - rest - step((4, 4, 4, 4))) <= 1e-12 * plan.step_time


def test_layouts_the_trainer_cannot_split_unevenly_get_no_plan():
    job = _job()
    planner = _planner(job)
    zero3 = Layout(tp=8, pp=1, dp=4, micro_batch=1, zero_stage=3)
    assert "parallel.zero_stage=3" in planner.unsupported(zero3, job) and planner.plan(zero3, job) is None
    same_kind = HeteroPlanner(Workload.from_job(job), load_cluster("mixed-h100-a100"), 16)
    assert same_kind.unsupported(Layout(tp=8, dp=2), job) == "the devices used are all of one kind"


def test_plan_write_gives_a_config_the_trainer_accepts(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model = tmp_path / "model.yaml"
    model.write_text(
        "model: {arch: llama, num_layers: 12, hidden_size: 2048, num_attention_heads: 16, num_kv_heads: 4,\n"
        "        vocab_size: 32000, seq_length: 2048}\n"
        "train: {global_batch_size: 64, micro_batch_size: 1, precision: bf16}\n"
    )
    out = tmp_path / "best.yaml"
    args = ["--config", str(model), "--cluster", "mixed-h100-a100", "--gpus", str(GPUS), "--top", "3"]
    assert tool.main([*args, "--write", str(out), "--no-explain"]) == 0
    printed = capsys.readouterr().out
    assert "heterogeneous plan for" in printed and "the best even layout's" in printed
    job = load(out)
    dp = validate_world(job, GPUS)
    uneven = job.train.dp_micro_batches or job.parallel.stage_layers
    assert uneven and len(set(uneven)) > 1, "the faster uneven split was not written"
    if job.train.dp_micro_batches:
        assert len(job.train.dp_micro_batches) == dp
