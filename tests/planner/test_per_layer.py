"""Per-layer plans: the cost model on per-layer recompute and own stage splits, and the coordinate descent
against exhaustive enumeration."""

import itertools
import random
from dataclasses import replace

import pytest

from llmtrain.config.schema import ModelConfig
from llmtrain.planner import CostModel, Layout, Workload, load_cluster, plan
from llmtrain.planner.search.per_layer import (
    MODES,
    PerLayerSearch,
    Plan,
    enumerate_plans,
    plan_of,
    search_per_layer,
)
from llmtrain.planner.search.uniform import build_space
from llmtrain.planner.validation.per_layer import compare, random_problem

H100 = load_cluster("h100-80gb")
LLAMA = ModelConfig(
    arch="llama", num_layers=8, hidden_size=2048, num_attention_heads=16, num_kv_heads=4, vocab_size=32000,
    seq_length=4096,
)  # fmt: skip


def model(gpus: int = 8, batch: int = 16, memory_gb: float | None = None) -> CostModel:
    view = H100.view(gpus)
    if memory_gb is not None:
        view = replace(view, device=replace(view.device, memory_gb=memory_gb))
    return CostModel(Workload(LLAMA, batch), view)


@pytest.mark.parametrize("rc", MODES)
@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp=2, pp=4, dp=1, micro_batch=2),
        Layout(tp=1, pp=2, dp=4, schedule="zb_h1", zero_stage=1),
        Layout(tp=2, pp=2, dp=2, schedule="interleaved_1f1b", virtual_stages=2, sequence_parallel=True),
        Layout(tp=1, pp=1, dp=8, zero_stage=3),
    ],
)
def test_a_uniform_plan_spelled_per_layer_costs_what_the_uniform_layout_costs(layout, rc):
    m = model()
    uniform = m.evaluate(replace(layout, recompute=rc))
    spelled = replace(layout, layer_recompute=(rc,) * 8, stage_layers=m.chunk_layers(layout))
    per_layer = m.evaluate(spelled)
    # The same sums in another order: a few fp64 roundings apart.
    assert per_layer.step_time == pytest.approx(uniform.step_time, rel=1e-12)
    assert per_layer.recompute == pytest.approx(uniform.recompute, rel=1e-12)
    # Memory over every rank instead of the first and last: the same fullest rank under the trainer's split.
    assert per_layer.memory["total"] == pytest.approx(uniform.memory["total"], rel=1e-12)


def test_a_plan_costs_the_same_whatever_order_its_chunks_layers_run_their_modes():
    """What enumerate_plans relies on to enumerate counts per chunk instead of every assignment: brute force
    over all 3^6 assignments of two splits."""
    m = CostModel(Workload(replace(LLAMA, num_layers=6), 8), H100.view(4))
    for split in ((3, 3), (2, 4)):
        by_counts: dict = {}
        for modes in itertools.product(MODES, repeat=6):
            lay = Layout(tp=2, pp=2, dp=1, layer_recompute=modes, stage_layers=split)
            est = m.evaluate(lay)
            key = plan_of(lay, m).chunks
            value = (est.step_time, est.memory["total"])
            assert by_counts.setdefault(key, value) == pytest.approx(value, rel=1e-12)
        assert len(by_counts) == 10 * 10 if split == (3, 3) else 6 * 15


def test_mixed_recompute_lies_between_the_uniform_modes_and_is_monotone():
    m = model(gpus=4, batch=4)
    base = Layout(tp=2, pp=2, dp=1)
    full, none = (m.evaluate(replace(base, recompute=rc)) for rc in ("full", "none"))
    previous = none
    for k in range(1, 8):  # the first k layers full, the rest none
        est = m.evaluate(replace(base, layer_recompute=("full",) * k + ("none",) * (8 - k)))
        assert none.step_time < est.step_time < full.step_time or k == 8
        assert est.memory["activations"] <= previous.memory["activations"]
        assert est.recompute > previous.recompute or est.recompute == previous.recompute > 0  # other rank
        previous = est
    assert full.memory["activations"] <= previous.memory["activations"]


def test_descent_beats_the_uniform_layout_where_memory_sits_between_its_modes():
    # One GPU, one micro-batch size: the uniform layouts differ in their recomputation only.
    work, view, fixed = Workload(replace(LLAMA, seq_length=8192), 2), H100.view(1), {"micro_batch": 1}
    need = {rc: plan(work, view, 1, {**fixed, "recompute": rc}).best.memory["total"] for rc in MODES}
    # A device between what full recomputation and none need: a uniform layout must recompute every
    # layer, a per-layer plan only some.
    device = replace(view.device, memory_gb=(need["full"] + need["none"]) / 2 / 2**30)
    m = CostModel(work, replace(view, device=device))
    uniform = plan(m.w, m.c, 1, fixed)
    found = search_per_layer(m, build_space(m, fixed), uniform.ranked)
    assert uniform.best.fits and uniform.best.layout.recompute != "none"
    assert found.best.fits and found.best.step_time < uniform.best.step_time and found.gain > 0
    lay = found.best.layout
    assert lay.layer_recompute and len(set(lay.layer_recompute)) > 1
    assert sum(lay.stage_layers) == 8 and not m.invalid_reason(lay)
    text = found.format()
    assert "recompute per layer: 0" in text and f"gain {100 * found.gain:.2f}%" in text


def test_descent_matches_the_enumeration_on_one_problem_and_evaluates_less():
    # Seed 2: a problem the descent missed by 3% before each global move settled its recomputation.
    work, view, name = random_problem(random.Random(2))
    gap = compare(work, view, name)
    assert gap is not None and gap.gap == pytest.approx(0.0, abs=1e-12)
    assert gap.evaluated < gap.enumerated


def test_enumeration_covers_every_split_and_count():
    m = CostModel(Workload(replace(LLAMA, num_layers=4), 2), H100.view(2))
    space = build_space(m, {"tp": 1, "micro_batch": 1})
    plans = list(enumerate_plans(m, space, Layout(tp=1, pp=1, dp=2)))
    # pp=1: one chunk of 4 layers, C(4+2, 2) = 15 mode counts; pp=2: splits 1+3, 2+2, 3+1 with their counts.
    assert len(plans) == 15 + (3 * 10 + 6 * 6 + 10 * 3)
    assert len(set(plans)) == len(plans) and all(isinstance(p, Plan) for p in plans)
    search = PerLayerSearch(m, space)
    assert all(search.eval(p) is not None for p in plans)


# The problems where a weaker descent misses the optimum: seeds of random_problem, found by running seeds
# 0-199 (something fits in all 200) with the descent crippled two ways against the enumeration. "unsettled":
# each global move judged with the recomputation it arrives with (the descent before 003e70d), missed on 12
# seeds by 0.1-16%: here all but 152 and 178 (13,000 and 30,000 plans to enumerate; 57 and 86 miss by more)
# and 2 (the test above). "one descent": one start instead of SEEDS restarts, missed on the 9 seeds below by
# 0.5-8% (all on one GPU). On the other 179 seeds the three descents agree, so these catch a regression of
# either kind at a tenth of the cost of the 100 problems benchmarks/bench_planner_search.py keeps for the gap
# statistics (100/100 exact when written).
HARD_SEEDS = {
    "unsettled": (22, 46, 49, 57, 86, 111, 141, 158, 176),
    "one descent": (16, 59, 70, 76, 79, 95, 96, 119, 166),
}


@pytest.mark.slow  # the problems each enumerated whole (up to ~19,000 plans): about ten CPU seconds
@pytest.mark.parametrize("seed", [s for seeds in HARD_SEEDS.values() for s in seeds])
def test_descent_finds_the_enumerated_optimum_where_a_weaker_descent_misses_it(seed):
    gap = compare(*random_problem(random.Random(seed)))
    assert gap is not None, seed
    # The enumeration holds every plan the descent can reach: never better; and exact, as on every seed
    # scanned (the same sums: a few fp64 roundings apart at most).
    assert gap.gap == pytest.approx(0.0, abs=1e-12), (gap.problem, gap.gap)
