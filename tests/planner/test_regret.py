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
    confirm_contenders,
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
    r = regret_check(name, job, CLUSTER, 2, fake, limit=3, progress=lines.append, confirm=0)
    overrides, _ = plan_for_world(job, 2, CLUSTER)
    assert layout_overrides(r.pick) == overrides
    assert [p.layout for p in r.points] == list(measured) and r.points[0].layout == r.pick
    assert r.regret == 1.0 and len(lines) == 3 and f"[regret {name} N=2 3/3]" in lines[-1]
    assert r.space == len(layouts) and not r.confirmed
    assert [p.predicted for p in r.points] == [model.evaluate(p.layout, use_simulator=True).step_time
                                               for p in r.points]  # fmt: skip


def test_the_confirmation_round_corrects_a_noisy_first_pass_round_robin():
    # The pick's first run caught a burst of other load (1.25 s against 1.0 s for the fastest): one pass says
    # regret 1.25. The contenders (within 1.30x of 1.0, and the pick) run twice more, one run of each per
    # round; the fourth layout (2.0 s, out of the band) keeps its one run.
    scripts = [[1.25, 0.9, 0.95], [1.0, 1.05, 1.0], [1.2, 1.1, 1.15], [2.0]]
    calls, order = [], {}

    def fake(layout):
        times = scripts[order.setdefault(layout, len(order))]
        calls.append(layout)
        return times[calls.count(layout) - 1]  # an out-of-band layout measured twice: IndexError

    lines = []
    r = regret_check("dense", _job("dense"), CLUSTER, 2, fake, limit=4, progress=lines.append)
    first = list(order)
    assert first[0] == r.pick and calls == [*first, *first[:3], *first[:3]]  # round-robin, band 1.30
    assert [p.measured for p in r.points] == [0.9, 1.0, 1.1, 2.0]  # each its fastest run
    assert r.regret == 1.0 and r.fastest.layout == r.pick and [p.layout for p in r.confirmed] == first[:3]
    assert len(lines) == 4 + 2 * 3 and "confirm round 2/2, 3/3]" in lines[-1]
    table = format_regret([r])
    assert "confirmed: 3 contenders (the pick and every layout whose first run is within 1.30x" in table
    rows = [line for line in table.splitlines() if line.startswith("  ") and "predicted" not in line][1:]
    assert rows[0].startswith(f"  pick {r.pick.short()} ") and rows[0].endswith("   3 confirmed")
    assert rows[-1].startswith(f"       {first[3].short()} ") and rows[-1].endswith("  2.0000     1")
    rec = r.record()
    assert (rec["band"], rec["confirm"], rec["confirmed_layouts"], rec["regret"]) == (1.3, 2, 3, 1.0)
    assert rec["rows"][0]["runs_s"] == [1.25, 0.9, 0.95] and rec["rows"][3] == {
        "layout": first[3].short(), "predicted_s": r.points[3].predicted, "measured_s": 2.0,
        "confirmed": False, "runs_s": [2.0],
    }  # fmt: skip


def test_an_out_of_band_pick_is_still_confirmed():
    pick, fast, near = (Layout(dp=2, micro_batch=b) for b in (4, 8, 2))
    calls = []
    runs = confirm_contenders({pick: 2.0, fast: 1.0, near: 1.4}, pick, lambda lay: calls.append(lay) or 1.5)
    assert calls == [pick, fast, pick, fast]  # near: 1.4 > 1.30 * 1.0, out; the pick whatever its time
    assert runs == {pick: [2.0, 1.5, 1.5], fast: [1.0, 1.5, 1.5]}


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
    for args, message in (
        (["--regret-band", "0.9"], "--regret-band must be at least 1 (a factor of the fastest first run)"),
        (["--regret-confirm", "-1"], "--regret-confirm must be at least 0 (runs after the first)"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--regret", *args])
        assert exit_.value.code == 2
        assert f"error: {message}; got {args[1]}" in capsys.readouterr().err.splitlines()[-1]
