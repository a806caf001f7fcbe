"""Config loading, overrides and validation: each bad input names the field and the fix."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from llmtrain.config import ConfigError, JobConfig, dump, load, parse_override, validate, validate_world

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    job = load(path)
    assert isinstance(job, JobConfig)


def test_public_field_names_are_stable():
    job = load(
        None,
        [
            "model.arch=llama",
            "model.num_layers=3",
            "model.hidden_size=96",
            "model.num_attention_heads=6",
            "model.num_kv_heads=2",
            "model.ffn_hidden_size=200",
            "model.vocab_size=1000",
            "model.seq_length=32",
            "train.steps=7",
            "train.lr=0.01",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.seed=3",
            "logging.interval=2",
            "output_dir=/tmp/x",
        ],
    )
    assert (job.model.arch, job.model.num_layers, job.model.kv_heads, job.model.ffn_size) == (
        "llama",
        3,
        2,
        200,
    )
    assert (job.train.steps, job.train.lr, job.train.seed, job.logging.interval) == (7, 0.01, 3, 2)
    assert job.output_dir == "/tmp/x"


def test_yaml_then_overrides(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model:\n  num_layers: 2\ntrain:\n  steps: 5\n")
    job = load(cfg, ["train.steps=9"])
    assert job.model.num_layers == 2 and job.train.steps == 9


def test_dump_round_trips(tmp_path):
    job = load(CONFIGS / "llama3-8b.yaml", ["train.steps=11"])
    dump(job, tmp_path / "out.yaml")
    assert load(tmp_path / "out.yaml") == job


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stesp=3", "did you mean train.steps"),
        ("modle.num_layers=3", "did you mean model"),
        ("model.num_layers=two", "model.num_layers must be an integer"),
        ("model.arch=bert", "model.arch must be one of gpt, llama, ernie, mixtral, qwen3_moe, ernie_moe"),
        ("parallel.sequence_parallel=3", "must be true or false"),
        ("model.num_kv_heads=3", "num_attention_heads=4 is not divisible by model.num_kv_heads=3"),
        ("model.hidden_size=250", "hidden_size=250 is not divisible by model.num_attention_heads"),
        ("parallel.tp=3", "parallel.tp=3 does not divide model.num_attention_heads"),
        ("train.micro_batch_size=5", "not a multiple of train.micro_batch_size=5"),
        ("parallel.virtual_stages=2", "needs parallel.schedule=interleaved_1f1b"),
        ("parallel.zero_stage=4", "parallel.zero_stage must be 0, 1, 2 or 3"),
        ("parallel.schedule=zb_v", "parallel.schedule=zb_v .*needs parallel.pp > 1"),
        ("data.split=1,2", "data.split must be three"),
        ("logging.profile_steps=[5,2]", "logging.profile_steps must be [first, last]"),
        ("train.lr=0", "train.lr must be positive"),
    ],
)
def test_bad_values_name_field_and_fix(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load(None, [override])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["parallel.schedule=zb_v"],
            "zb_v runs exactly two chunks per rank (a V); set parallel.virtual_stages=2",
        ),
        (
            ["parallel.schedule=dualpipe_v", "parallel.virtual_stages=3"],
            "set parallel.virtual_stages=2 (got 3)",
        ),
        (
            ["parallel.schedule=dualpipe_v", "parallel.virtual_stages=2", "parallel.dp=1"],
            "dualpipe_v needs at least 2 * parallel.pp = 4 micro-batches per step; got 2",
        ),
    ],
)
def test_v_schedules_refuse_what_they_cannot_run(overrides, expected):
    # Two pipeline ranks, 8 layers, a global batch of 2 micro-batches on one data-parallel replica.
    base = ["parallel.pp=2", "model.num_layers=8", "train.global_batch_size=2", "train.micro_batch_size=1"]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(None, [*base, *overrides])
    assert load(None, [*base, "parallel.schedule=zb_v", "parallel.virtual_stages=2"]).parallel.pp == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
            "does not support parallel.engine=deepspeed",
        ),
        (["model.recompute=full"], "does not support model.recompute=full with router losses yet"),
    ],
)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "ernie_moe"])
def test_moe_rejects_layouts_it_does_not_support(arch, overrides, expected):
    """Layouts the experts do not support yet fail at config time (router losses are on by default)."""
    with pytest.raises(ConfigError, match=re.escape(f"model.arch={arch} (mixture of experts) {expected}")):
        load(None, [f"model.arch={arch}", *overrides])
    # The same layouts (but DeepSpeed, which may not be installed) stay fine for a dense model.
    dense = [o for o in overrides if not o.startswith("parallel.engine")]
    assert load(None, ["model.arch=llama", *dense]).model.arch == "llama"


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_moe_router_terms_run_under_pipeline_and_context_parallelism(arch):
    """The router losses and the score-bias update (arch defaults) span pipeline stages and CP ranks."""
    for layout in (["parallel.pp=2"], ["parallel.cp=2"], ["parallel.pp=2", "parallel.cp=2"]):
        job = load(None, [f"model.arch={arch}", *layout])
        assert job.model.router_aux_loss_coef > 0 or job.model.bias_update_rate > 0


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model.num_experts=3", "model.num_experts_per_tok=5"],
            "num_experts_per_tok=5 exceeds model.num_experts=3",
        ),
        (["model.moe_layer_interval=0"], "model.moe_layer_interval must be at least 1"),
        (["model.num_experts_per_tok=0"], "model.num_experts_per_tok must be at least 1"),
        (["model.arch=qwen3_moe", "model.num_shared_experts=1"], "qwen3_moe has no shared experts"),
        (["model.use_bias=true"], "set model.use_bias=false"),
        (["model.dense_layers=[4]"], "model.dense_layers names layer 4, outside 0..3"),
    ],
)
def test_bad_moe_fields_name_the_field(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(None, ["model.arch=mixtral", *overrides])


def test_pipeline_chunks_need_layers():
    with pytest.raises(ConfigError, match="exceeds model.num_layers=4"):
        load(None, ["parallel.pp=4", "parallel.virtual_stages=2", "parallel.schedule=interleaved_1f1b"])


def test_weights_must_match_prefixes():
    with pytest.raises(ConfigError, match="give one weight per prefix"):
        load(None, ["data.prefixes=[a,b]", "data.weights=[1.0]"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml")


def test_override_syntax():
    assert parse_override("train.steps=20") == ("train.steps", 20)
    assert parse_override("parallel.cluster=null") == ("parallel.cluster", None)
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("train.steps")


def test_world_size_must_match_degrees():
    job = load(
        None, ["parallel.tp=2", "parallel.dp=2", "train.global_batch_size=16", "train.micro_batch_size=4"]
    )
    assert validate_world(job, 4) == 2
    with pytest.raises(ConfigError, match="runs on 8 processes"):
        validate_world(job, 8)
    inferred = load(None, ["parallel.tp=2", "train.global_batch_size=16", "train.micro_batch_size=2"])
    assert validate_world(inferred, 8) == 4
    with pytest.raises(ConfigError, match="not divisible by parallel.tp"):
        validate_world(inferred, 3)


def test_uneven_micro_batches_per_replica_are_checked():
    base = ["train.global_batch_size=12", "train.micro_batch_size=2"]
    job = load(None, [*base, "train.dp_micro_batches=[4,2]"])
    # 12 / (2 * 4) is no whole count: only equal shares need the divisibility.
    assert validate_world(job, 2) == 2
    with pytest.raises(ConfigError, match="has 2 entries for the data-parallel degree 3"):
        validate_world(job, 3)
    with pytest.raises(ConfigError, match=r"summing to train.global_batch_size / train.micro_batch_size = 6"):
        load(None, [*base, "train.dp_micro_batches=[4,1]"])
    with pytest.raises(ConfigError, match="positive counts"):
        load(None, [*base, "train.dp_micro_batches=[6,0]"])
    for setting in ("parallel.pp=2", "parallel.zero_stage=2", "parallel.cp=2"):
        with pytest.raises(ConfigError, match=f"not supported with {setting}.*leave train.dp_micro_batches"):
            load(None, [*base, "train.dp_micro_batches=[4,2]", setting])


def _literal_fields(section: object, prefix: str = "") -> list[tuple[str, tuple[str, ...]]]:
    """(dotted name, choices) of every Literal-typed field of a JobConfig, found by reading types."""
    found = []
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            found += _literal_fields(value, f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            found.append((f"{prefix}{f.name}", typing.get_args(hints[f.name])))
    return found


def test_validate_checks_every_choice_field_set_in_code():
    """A config changed in code (not through the loader, which checks choices itself) is still held to the
    choices of every Literal field."""
    fields = _literal_fields(JobConfig())
    assert len(fields) >= 7  # arch, kernels, recompute, schedule, precision, lr_decay, on_save_error
    for name, choices in fields:
        job = JobConfig()
        target = job
        for part in name.split(".")[:-1]:
            target = getattr(target, part)
        setattr(target, name.rsplit(".", 1)[-1], "no-such-choice")
        expected = f"{name} must be one of {', '.join(choices)}; got 'no-such-choice'"
        with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
            validate(job)
