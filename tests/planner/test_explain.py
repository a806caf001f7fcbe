"""The planner's explanation: the chosen layout's time parts, and what ruled out each runner-up."""

from dataclasses import replace

import pytest

from llmtrain.config import load
from llmtrain.config.schema import ModelConfig
from llmtrain.planner import CostModel, Layout, Workload, load_cluster, plan, plan_job
from llmtrain.planner.cost.layout import GIB
from llmtrain.planner.report.explain import PART_LABELS, explain, format_explanation, time_parts, why_not

H100 = load_cluster("h100-80gb")
LLAMA = ModelConfig(
    arch="llama", num_layers=16, hidden_size=2048, num_attention_heads=16, num_kv_heads=4, vocab_size=32000,
    seq_length=2048,
)  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [
        Layout(
            tp=2, pp=4, dp=2, micro_batch=1, schedule="1f1b", recompute="selective", sequence_parallel=True
        ),
        Layout(tp=1, pp=2, dp=8, micro_batch=2, schedule="zb_h1", recompute="full", zero_stage=1),
        Layout(tp=2, pp=2, dp=4, micro_batch=1, schedule="interleaved_1f1b", virtual_stages=2, zero_stage=3),
        Layout(tp=1, pp=1, dp=16, micro_batch=1, zero_stage=2, dp_shard=8),
    ],
)
@pytest.mark.parametrize("simulate", [False, True])
def test_the_time_parts_sum_to_the_step_time(layout, simulate):
    # 32 nodes of 8: pipeline sends and DP collectives cross nodes, so every part can be non-zero.
    model = CostModel(Workload(LLAMA, 64), H100.view(16))
    est = model.evaluate(layout, use_simulator=simulate)
    parts = time_parts(est)
    assert list(parts) == list(PART_LABELS)
    assert all(v >= 0 for v in parts.values()), parts
    # Summed in another order than the cost model's: agreement to a few fp64 roundings of the step.
    assert sum(parts.values()) == pytest.approx(est.step_time, rel=1e-12)
    if layout.pp > 1:
        assert parts["bubble"] > 0 and parts["p2p"] > 0
    assert (parts["recompute"] > 0) == (layout.recompute != "none")


def test_a_layout_worse_only_by_its_bubble_is_explained_by_it():
    # One node whose links cost nothing: sends are free, so the schedules differ in their bubble only.
    view = H100.view(8)
    free = replace(view.intra, latency_us=0.0, bandwidth_gbs=1e12)
    view = replace(view, intra=free)
    model = CostModel(Workload(LLAMA, 64), view)
    chosen = model.evaluate(Layout(tp=2, pp=4, dp=1, schedule="interleaved_1f1b", virtual_stages=2))
    # Plain 1f1b runs the same layers on the same ranks (same compute, TP, optimizer) but fills and drains
    # the pipeline with chunks twice as long: (p - 1)(f + b) against (p - 1)(f + b) / v.
    other = model.evaluate(Layout(tp=2, pp=4, dp=1))
    mine, theirs = time_parts(other), time_parts(chosen)
    for key in ("compute", "recompute", "tp", "dp", "optimizer"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-12), key
    assert mine["p2p"] < 1e-9 and theirs["p2p"] < 1e-9
    extra = other.step_time - chosen.step_time
    assert mine["bubble"] == pytest.approx(2 * theirs["bubble"], rel=1e-9)
    assert why_not(other, chosen, view) == f"{extra:+.3f} s: {extra:+.3f} s 1f1b fill and drain"
    # On a real node the extra round trips of 1f1b's sends are named too.
    real = CostModel(Workload(LLAMA, 64), H100.view(8))
    chosen = real.evaluate(Layout(tp=2, pp=4, dp=1, schedule="interleaved_1f1b", virtual_stages=2))
    other = real.evaluate(Layout(tp=2, pp=4, dp=1))
    sends = time_parts(other)["p2p"] - time_parts(chosen)["p2p"]
    assert why_not(other, chosen, H100.view(8)).endswith(
        f"fill and drain, {sends:+.3f} s PP sends inside a node"
    )


@pytest.mark.slow  # 2 s: with the whole suite, not the quick subset
def test_a_faster_runner_up_that_does_not_fit_is_reported_with_its_memory():
    # Long sequences, cp held at 1 (splitting the sequence divides the activations, so nothing faster would be
    # ruled out by memory): plain data parallelism would be faster, but its activations do not fit.
    job = load("configs/llama3-70b.yaml", ["model.seq_length=16384"])
    result = plan_job(job, H100, 64, fixed={"cp": 1})
    expl = explain(result, H100.view(64))
    est, line = expl.runners_up[0]
    assert not est.fits and est.step_time < result.best.step_time and est.layout.recompute == "none"
    total = est.memory["total"] / GIB
    assert line.startswith(
        f"does not fit: {total:.1f}/80 GiB though {est.step_time - result.best.step_time:+.3f} s"
    )
    activations = est.memory["activations"] / GIB
    assert f"(activations {activations:.1f} GiB, " in line or "(startup peak; " in line
    assert any(e.fits for e, _ in expl.runners_up[2:])  # then the best fitting families
    text = format_explanation(expl, "bf16", "64 x H100")
    assert "recompute" in text and "does not fit" in text and "memory per rank" in text
    assert expl.as_dict()["runners_up"][0]["why_not"] == line


def test_every_runner_up_family_appears_once_and_the_chosen_family_not_at_all():
    result = plan(Workload(LLAMA, 64), H100, 16, simulate_top=False)
    expl = explain(result, H100.view(16), runners_up=6)
    family = lambda e: (e.layout.tp, e.layout.pp, e.layout.zero_stage, e.layout.recompute)  # noqa: E731
    families = [family(e) for e, _ in expl.runners_up]
    assert len(families) == len(set(families)) == 6 and family(result.best) not in families
    for est, line in expl.runners_up:
        if est.fits:
            assert line.startswith(f"{est.step_time - result.best.step_time:+.3f} s")


def test_zb_v_is_chosen_when_few_micro_batches_leave_a_large_bubble_and_the_explanation_says_why():
    # 8 layers on pp=4, dp=2, a global batch of 6: 3 micro-batches per step, fewer than pp, which the
    # interleaved schedules refuse; ZB-V's split backward fills most of the bubble at 1F1B's activations.
    model = ModelConfig(
        arch="llama", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
        vocab_size=32000, seq_length=4096,
    )  # fmt: skip
    fixed = {"pp": 4, "micro_batch": 1, "recompute": "selective", "zero_stage": 1}
    result = plan(Workload(model, 6), H100, 8, fixed=fixed, method="exhaustive")
    assert result.best.layout.schedule == "zb_v"
    expl = explain(result, H100.view(8))
    others = {e.layout.schedule: e for e, _ in expl.schedules}
    assert {"1f1b", "zb_h1"} <= set(others)
    assert all(e.pp_bubble > result.best.pp_bubble for e in others.values())
    text = format_explanation(expl, "bf16", "H100")
    assert "zb_v wins over the other pipeline schedules of this layout" in text
    assert expl.as_dict()["schedules"][0]["against_chosen"].startswith("+")
