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
from llmtrain.planner.validation.per_layer import compare, gap_statistics, random_problem

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
    work, view, name = random_problem(random.Random(3))
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


@pytest.mark.slow  # 100 problems each enumerated whole (~5,600 plans each): about a CPU minute
def test_descent_against_exhaustive_search_on_100_random_problems():
    gaps, stats = gap_statistics(100, seed=0)
    print(
        f"\nper-layer descent vs exhaustive over {stats['problems']} problems: mean gap "
        f"{100 * stats['mean_gap']:.3f}%, max {100 * stats['max_gap']:.2f}%, "
        f"exact {100 * stats['exact_share']:.0f}%, {stats['mean_evaluated']:.0f} plans evaluated against "
        f"{stats['mean_enumerated']:.0f} enumerated"
    )
    # The enumeration holds every plan the descent can reach: the descent is never better.
    assert min(g.gap for g in gaps) >= -1e-12
    # Coordinate descent is a heuristic: an optimum needing two coordinates changed at once (a micro-batch
    # or tp change that only pays with the recomputation re-chosen) is why each global move is judged with
    # its recomputation settled. Measured: 100 of 100 exact (92 before settling, misses up to 4% slower);
    # these bounds catch a regression, not noise (the problems are seeded).
    assert stats["exact_share"] >= 0.95
    assert stats["mean_gap"] <= 0.005
