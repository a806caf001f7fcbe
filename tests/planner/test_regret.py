"""The regret check's pieces (issue 38 point 4), no training runs: the layouts it takes from the planner's
space and the rule that cuts them, that each loads as a training config, the regret and Spearman
arithmetic, and that its pick is parallel.auto's (plan_for_world) for the same job, processes and cluster,
with the measurement replaced by a table of times."""

import importlib.util
import math
from pathlib import Path

import pytest

from llmtrain.config import load
from llmtrain.config.validate import validate_world
from llmtrain.planner import CostModel, Workload, plan, plan_for_world
from llmtrain.planner.auto import choose_layout, layout_overrides, run_software
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.validation.local import LocalPoint, run_overrides
from llmtrain.planner.validation.regret import (
    MEASURED_RULE,
    REGRET_JOBS,
    RegretResult,
    format_regret,
    measured_set,
    regret_check,
    rule_micro_batch,
    settings_apart,
    space_layouts,
)
from tests.planner.test_local_validation import local_like_cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER = local_like_cluster()


def _job(name):
    config, overrides = REGRET_JOBS[name]
    return load(REPO / config, list(overrides))


def _model(name, processes):
    job = _job(name)
    return job, CostModel(Workload.from_job(job), CLUSTER.view(processes), run_software(job))


@pytest.fixture(scope="module", params=["dense", "moe"])
def two(request):
    """(name, job, model, space layouts) at 2 processes."""
    job, model = _model(request.param, 2)
    return request.param, job, model, space_layouts(model)


def test_the_space_is_the_one_the_exhaustive_search_evaluates(two):
    name, job, model, layouts = two
    result = plan(Workload.from_job(job), CLUSTER, 2, software=run_software(job), method="exhaustive")
    assert len(layouts) == len(set(layouts)) == result.evaluated
    assert {e.layout for e in result.ranked} == set(layouts)
    assert all(not model.invalid_reason(lay) for lay in layouts)
    assert {lay.ep for lay in layouts} == ({1} if name == "dense" else {1, 2})


def test_every_measured_layout_loads_as_exactly_that_layout(two, tmp_path):
    name, job, model, layouts = two
    config, overrides = REGRET_JOBS[name]
    chosen = measured_set(layouts, choose_layout(job, 2, CLUSTER)[0].layout, job.train.global_batch_size)
    for layout in chosen:
        run = load(REPO / config, [*overrides, *run_overrides(layout, 4, str(tmp_path))])
        assert validate_world(run, 2) == layout.dp
        assert layout_overrides(layout).items() <= _flat(run).items()


def _flat(job):
    """The job's settings as the `key.path: value` items layout_overrides writes."""
    out = {}
    for section in ("parallel", "train", "model"):
        for key, value in vars(getattr(job, section)).items():
            out[f"{section}.{key}"] = value
    return out


def test_the_cut_keeps_the_pick_each_grid_point_and_nothing_else(two):
    name, job, model, layouts = two
    pick = choose_layout(job, 2, CLUSTER)[0].layout
    chosen = measured_set(layouts, pick, 16)
    assert chosen[0] == pick and len(set(chosen)) == len(chosen) < len(layouts)
    grid = {(lay.tp, lay.pp, lay.dp, lay.ep, lay.schedule, lay.zero_stage) for lay in layouts}
    assert {(lay.tp, lay.pp, lay.dp, lay.ep, lay.schedule, lay.zero_stage) for lay in chosen} == grid
    for lay in chosen[1:]:
        one_away = settings_apart(lay, pick) == 1
        plain = (lay.recompute, lay.dp_shard, lay.grad_reduce) == ("none", None, "microbatch")
        assert one_away or (plain and lay.micro_batch == rule_micro_batch(16 // lay.dp, lay.pp, range(1, 17)))
        assert lay.offload == "none"
    assert "plus the pick and every layout one setting away from it" in MEASURED_RULE


def test_rule_micro_batch():
    assert rule_micro_batch(16, 1, [1, 2, 4, 8, 16]) == 16  # no pipeline: one micro-batch
    assert rule_micro_batch(16, 2, [1, 2, 4, 8, 16]) == 4  # 4 micro-batches = 2 * pp
    assert rule_micro_batch(16, 4, [1, 2, 4, 8, 16]) == 2  # 8 micro-batches
    assert rule_micro_batch(4, 4, [2, 4]) == 2  # fewer than 2 * pp whatever the size: the smallest


def test_settings_apart_counts_each_setting_once():
    base = Layout(pp=2, micro_batch=4)
    assert settings_apart(base, base) == 0
    assert settings_apart(base, Layout(pp=2, micro_batch=2)) == 1
    interleaved = Layout(pp=2, micro_batch=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert settings_apart(base, interleaved) == 1
    assert settings_apart(base, Layout(pp=2, micro_batch=4, zero_stage=2, grad_reduce="step")) == 1
    assert settings_apart(base, Layout(dp=2, micro_batch=4)) == 1  # another grid point: dp follows
    assert settings_apart(base, Layout(dp=2, micro_batch=8, recompute="full")) == 3


def _result(times, predicted, pick_index=0):
    layouts = [Layout(dp=2, micro_batch=b) for b in (1, 2, 4, 8)][: len(times)]
    points = [LocalPoint(lay, p, m) for lay, p, m in zip(layouts, predicted, times, strict=True)]
    return RegretResult("dense", 2, layouts[pick_index], points, space=99)


def test_regret_is_the_pick_over_the_fastest_and_spearman_ranks_predicted_vs_measured():
    r = _result([2.0, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert r.fastest.layout.micro_batch == 2
    assert r.regret == pytest.approx(2.0) and not r.meets
    assert r.spearman == pytest.approx(0.8)  # one swapped pair of 4: 1 - 6*2/(4*15)
    close = _result([1.04, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert close.regret == pytest.approx(1.04) and close.meets
    assert _result([1.0, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], pick_index=1).regret == 1.0  # tied fastest
    assert math.isnan(_result([1.0], [1.0]).spearman)


def test_report_line_names_the_regret_and_the_json_carries_it():
    r = _result([2.0, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    text = format_regret([r])
    assert MEASURED_RULE in text.splitlines()[0]
    assert "regret of parallel.auto's pick (dense, 2 processes): 2.000 (misses <= 1.05)" in text
    assert "Spearman of predicted vs measured (dense, 2 processes): +0.800 over 4 layouts" in text
    rec = r.record()
    assert (rec["regret"], rec["meets"], rec["space_layouts"], rec["measured_layouts"]) == (2.0, False, 99, 4)
    assert rec["pick"] == r.pick.short() and rec["fastest"] == r.fastest.layout.short()


def test_the_reported_pick_is_parallel_autos_choice_with_a_fake_measurement(two):
    name, job, model, layouts = two
    measured = {}

    def fake(layout):  # a table of times, growing in call order: the pick, measured first, is fastest
        measured[layout] = 1.0 + len(measured)
        return measured[layout]

    lines = []
    r = regret_check(name, job, CLUSTER, 2, fake, limit=3, progress=lines.append)
    overrides, _ = plan_for_world(job, 2, CLUSTER)
    assert layout_overrides(r.pick) == overrides
    assert [p.layout for p in r.points] == list(measured) and r.points[0].layout == r.pick
    assert r.regret == 1.0 and len(lines) == 3 and f"[regret {name} N=2 3/3]" in lines[-1]
    assert r.space == len(layouts)
    assert [p.predicted for p in r.points] == [model.evaluate(p.layout, use_simulator=True).step_time
                                               for p in r.points]  # fmt: skip


def test_parallel_auto_plans_for_the_kernels_the_run_uses():
    job = _job("dense")
    assert not run_software(job).fused_kernels  # CPU: PyTorch's reference ops
    triton = load(REPO / REGRET_JOBS["dense"][0], [*REGRET_JOBS["dense"][1], "model.kernels=triton"])
    assert run_software(triton).fused_kernels


def test_bad_regret_arguments_fail_before_any_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("validate_planner", REPO / "benchmarks/validate_planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    missing = str(tmp_path / "local4.yaml")
    assert bench.main(["--regret", "--regret-processes", "4", "--local-cluster4", missing]) == 2
    assert f"cluster file {missing} does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--regret", "--regret-models", "dense,sparse"])
    assert exit_.value.code == 2
    assert "--regret-models: unknown sparse; use some of dense, moe" in capsys.readouterr().err
