"""Search: pruning with reasons, coordinate descent against exhaustive enumeration, speed, parallel.auto."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from llmtrain.config import ConfigError, load, validate_world
from llmtrain.config.schema import JobConfig, ModelConfig, TrainConfig
from llmtrain.config.validate import pipeline_problem, tensor_parallel_problem
from llmtrain.planner import (
    Software,
    Workload,
    cluster_from_dict,
    load_cluster,
    parse_fixed,
    plan,
    plan_for_world,
    plan_job,
)
from llmtrain.planner.auto import layout_overrides
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.cost.model import CostModel
from llmtrain.planner.report.files import write_config
from llmtrain.planner.report.tables import format_table, to_records
from llmtrain.planner.search.uniform import build_space

ROOT = Path(__file__).resolve().parents[2]

A100 = load_cluster("a100-80gb")


def gpt(layers, hidden, heads, seq=2048, vocab=51200):
    return ModelConfig(
        arch="gpt",
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=vocab,
        seq_length=seq,
    )


# One node with every sharding but hybrid; the megatron_2021 software (two sharding choices) on GQA; and four
# nodes with every sharding, hybrid included, where the optimum shards the gradients (zero 2). In all three
# the optimum is pure data parallelism (tp = pp = 1), reached by the first descent; the enumeration is what
# proves no other layout beats it. gpt(24, 2048, 16) on 16 GPUs (60,000 combinations) was a fourth case: the
# same software, multi-node space and optimum shape as the 32-GPU one, zero 1 as on one node: it caught
# nothing the other three do not, at a third of the time.
SMALL_SPACES = [
    (gpt(8, 1024, 16, 1024), 64, 8, None),
    (
        ModelConfig(
            arch="llama",
            num_layers=16,
            hidden_size=2048,
            num_attention_heads=16,
            num_kv_heads=4,
            vocab_size=32000,
            seq_length=2048,
        ),
        128,
        16,
        Software.megatron_2021(),
    ),
    (gpt(32, 4096, 32), 128, 32, None),
]


@pytest.mark.slow  # 11,000-65,000 combinations enumerated a case: runs in CI, not in -m 'not slow'
@pytest.mark.parametrize("model,batch,gpus,software", SMALL_SPACES)
def test_coordinate_descent_finds_the_exhaustive_optimum(model, batch, gpus, software):
    work = Workload(model, batch, "bf16")
    exhaustive = plan(work, A100, gpus, software=software, method="exhaustive", simulate_top=False)
    descent = plan(work, A100, gpus, software=software, method="coordinate", simulate_top=False)
    best = min((e for e in exhaustive.ranked if e.fits), key=lambda e: e.step_time)
    assert exhaustive.best is best
    assert descent.best.step_time == pytest.approx(best.step_time, rel=1e-12)
    assert descent.evaluated < exhaustive.evaluated


def test_pruning_gives_reasons():
    model = gpt(4, 768, 12, 1024, vocab=50304)
    space = build_space(CostModel(Workload(model, 48, "bf16"), A100.view(16)))
    # The model's own rules come word for word from config validation (tests/planner/test_tp_rule.py).
    assert tensor_parallel_problem(model, 16) in space.pruned
    assert "parallel.tp=16 does not divide model.num_attention_heads=12" in tensor_parallel_problem(model, 16)
    assert all(tp <= 8 for tp, _ in space.tp_pp)  # tp stays inside a node of 8
    assert pipeline_problem(4, 16) in space.pruned
    cm = CostModel(Workload(model, 48, "bf16"), A100.view(16))
    assert "multiple of micro_batch*dp" in cm.invalid_reason(Layout(tp=1, pp=1, dp=16, micro_batch=2))
    assert "ZeRO needs dp > 1" in CostModel(Workload(model, 48, "bf16"), A100.view(8)).invalid_reason(
        Layout(tp=4, pp=2, dp=1, micro_batch=1, zero_stage=1)
    )


def test_fixed_settings_are_respected():
    fixed = parse_fixed("parallel.tp=4 parallel.pp=2 model.recompute=full parallel.schedule=1f1b")
    assert fixed == {"tp": 4, "pp": 2, "recompute": "full", "schedule": "1f1b"}
    result = plan(Workload(gpt(24, 2048, 16), 256, "bf16"), A100, 32, fixed)
    assert all(
        (e.layout.tp, e.layout.pp, e.layout.recompute, e.layout.schedule) == (4, 2, "full", "1f1b")
        for e in result.ranked
    )
    with pytest.raises(ConfigError, match="not a planner setting"):
        parse_fixed("train.lr=0.1")


@pytest.mark.slow  # about 10 s of descent on 2 cores: with the multi-second tests
def test_trillion_parameters_on_3072_gpus_plans_by_descent_over_a_small_part_of_the_space(monkeypatch):
    """The search stays interactive (benchmarks/bench_planner_search.py times it) by evaluating few layouts:
    counted, not timed, so a loaded machine cannot fail it and a search that blows up still does."""
    work, software = Workload(gpt(128, 25600, 160), 3072, "bf16"), Software(sharded_init=True)
    estimates = []
    evaluate = CostModel.evaluate
    monkeypatch.setattr(
        CostModel, "evaluate", lambda self, *a, **kw: estimates.append(1) or evaluate(self, *a, **kw)
    )
    # Built shard by shard as Megatron does: a whole 1T model in fp32 (4 TB) fits no rank.
    result = plan(work, A100, 3072, top=10, software=software)
    assert result.best.fits and result.method == "coordinate-descent"
    assert 0.3 < result.best.mfu < 0.75
    space = build_space(CostModel(work, A100.view(3072), software))
    grid = [3072 // (tp * pp * cp) for tp, pp, cp, _, _ in space.grid()]
    # Descent screens every (tp, pp, cp, ep) point with each sharding and at most two recompute modes, then
    # each of its 8 seeds walks every dimension's neighbourhood; three sweeps a seed is ample (15 sweeps in
    # all for the 8 seeds when written). That bounds it to under 2% of the 219,600 combinations.
    screen = sum(2 * len(space.sharding[dp]) for dp in grid)
    neighbourhood = (
        len(space.tp_pp)
        + max(map(len, space.contexts.values()))
        + len(space.experts)
        + max(map(len, space.micro_batches.values()))
        + len(space.schedules)
        + len(space.recompute)
        + len(space.sequence_parallel)
        + max(map(len, space.sharding.values()))
    )
    assert result.evaluated <= screen + 8 * 3 * neighbourhood < space.size() / 50
    assert len(estimates) == result.evaluated + 10  # each layout estimated once, the top 10 re-timed once


def test_table_json_and_written_config(tmp_path):
    job = JobConfig(model=gpt(8, 1024, 16, 1024), train=TrainConfig(global_batch_size=64, precision="bf16"))
    result = plan(Workload.from_job(job), A100, 16, top=3)
    table = format_table(result, 3)
    assert "TFLOP/s" in table and table.count("\n") >= 4
    record = to_records(result, 3)[0]
    for key in (
        "tp",
        "pp",
        "dp",
        "virtual_stages",
        "micro_batch",
        "recompute",
        "sequence_parallel",
        "zero_stage",
        "step_time_s",
        "tflops_per_gpu",
        "mfu",
        "memory_gb",
        "fits",
    ):
        assert key in record
    path = tmp_path / "best.yaml"
    write_config(job, result.best, path)
    loaded = load(path)
    assert validate_world(loaded, 16) == result.best.layout.dp
    assert loaded.train.micro_batch_size == result.best.layout.micro_batch


def test_plan_for_world_returns_loadable_overrides():
    job = load(
        None,
        [
            "model.arch=llama",
            "model.num_layers=4",
            "model.hidden_size=256",
            "model.num_attention_heads=4",
            "train.global_batch_size=16",
            "train.micro_batch_size=1",
            "parallel.auto=true",
        ],
    )
    for world in (4, 8):
        overrides, why = plan_for_world(job, world, A100)
        again = load(
            None,
            [
                *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()),
                "model.arch=llama",
                "model.num_layers=4",
                "model.hidden_size=256",
                "model.num_attention_heads=4",
                "train.global_batch_size=16",
            ],
        )
        assert validate_world(again, world) == overrides["parallel.dp"]
        assert "parallel.auto chose" in why and "s/step" in why


def test_nothing_fits_is_explained():
    job = load(
        None,
        [
            "model.arch=gpt",
            "model.num_layers=96",
            "model.hidden_size=12288",
            "model.num_attention_heads=96",
            "model.seq_length=2048",
            "model.vocab_size=51200",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
        ],
    )
    with pytest.raises(ConfigError, match="fits"):
        plan_for_world(job, 8, A100)


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_gradient_reduction_is_searched_and_chosen_by_time_where_it_fits():
    """FSDP2's gradient reduction (parallel.grad_reduce) is part of the sharding choice at zero 2/3. Behind a
    1 GB/s inter-node link (a100-40gb otherwise), LLaMA 3B at zero 2, tp=pp=1, one sample per micro-batch
    over 32 GPUs (16 micro-batches per step): reducing once a step instead of 16 times wins by ~4x and its
    unsharded fp32 gradient fits, so the planner takes it; LLaMA-3 70B on 64 H100s keeps reducing every
    micro-batch, where the unsharded gradient would not fit. A step of one micro-batch is the same run either
    way: it is evaluated once, as the per-micro-batch layout."""
    slow = yaml.safe_load((ROOT / "llmtrain/planner/clusters/a100-40gb.yaml").read_text())
    slow["links"]["inter_node"]["bandwidth_gbs"] = 1.0
    fixed = dict(zero_stage=2, tp=1, pp=1, micro_batch=1)
    result = plan_job(load(ROOT / "configs/llama-3b.yaml"), cluster_from_dict(slow), 32, 512, fixed, top=5)
    best = result.best
    assert best.fits and best.layout.grad_reduce == "step", best.layout.short()
    [other] = [e for e in result.ranked if e.layout == replace(best.layout, grad_reduce="microbatch")]
    assert other.fits and other.step_time > 2 * best.step_time
    assert "parallel.grad_reduce=step" in " ".join(
        f"{k}={v}" for k, v in layout_overrides(best.layout).items()
    )

    seventy = plan_job(load(ROOT / "configs/llama3-70b.yaml"), load_cluster("h100-80gb"), 64, top=5)
    assert seventy.best.fits and seventy.best.layout.grad_reduce == "microbatch"
    assert not any(
        e.fits for e in seventy.ranked if e.layout == replace(seventy.best.layout, grad_reduce="step")
    )

    # As the config refuses it (llmtrain.config.validate), once a step is FSDP2's choice alone.
    model = CostModel(
        Workload.from_job(load(ROOT / "configs/llama-3b.yaml"), 512), cluster_from_dict(slow).view(32)
    )
    for other in (Layout(dp=32, zero_stage=1), replace(best.layout, offload="optimizer")):
        why = model.invalid_reason(replace(other, grad_reduce="step"))
        assert "grad_reduce=step chooses how FSDP2 accumulates" in why, why
    assert "grad_reduce must be one of" in model.invalid_reason(replace(best.layout, grad_reduce="sometimes"))

    one_micro = plan_job(
        load(ROOT / "configs/llama-1b.yaml"), load_cluster("h100-80gb"), 64, 64, {"zero_stage": 3}
    )
    single = [e.layout for e in one_micro.ranked if e.layout.dp * e.layout.micro_batch == 64]
    assert single and all(layout.grad_reduce == "microbatch" for layout in single)
    assert len(set(single)) == len(single)
