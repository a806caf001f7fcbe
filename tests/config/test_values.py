"""Config values in the spellings people write, on the command line, in YAML files and through sweeps.

References we did not write: Python's float() for what a float spelling means, the YAML 1.2.2 spec's core
schema patterns for which plain scalars are floats, and PyYAML's safe_load for every value YAML 1.1 already
read (which must not change).
"""

from __future__ import annotations

import math
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtrain.config import ConfigError, dump, load, to_dict
from llmtrain.config.loader import dump_yaml, load_yaml
from llmtrain.sweep import load_list, parse_grid

# Spellings of positive floats: YAML 1.2 forms YAML 1.1 read as strings, then forms both read.
FLOAT_FORMS = [
    "1e-3",
    "3E-4",
    "2.0e-3",
    ".5",
    "1e+3",
    "1.5E3",
    "+.5e-3",
    "5e-1",
    "1.0e-3",
    "0.01",
    "2.",
    "1_000.5",
]
NEGATIVE_FORMS = ["-1e-3", "-.5", "-2.0E-3"]


def _lr_config(tmp_path, lr: str | None = None):
    """A YAML job with train.min_lr 0 (so any positive lr validates), and train.lr as written if given."""
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  min_lr: 0\n" + (f"  lr: {lr}\n" if lr is not None else ""))
    return path


@pytest.mark.parametrize("text", FLOAT_FORMS)
def test_float_spellings_on_the_command_line(text):
    job = load(None, [f"train.lr={text}", "train.min_lr=0"])
    assert type(job.train.lr) is float and job.train.lr == float(text)


@pytest.mark.parametrize("text", FLOAT_FORMS)
def test_float_spellings_in_a_yaml_file(tmp_path, text):
    job = load(_lr_config(tmp_path, text))
    assert type(job.train.lr) is float and job.train.lr == float(text)


def test_float_spellings_through_a_sweep_grid(tmp_path):
    base = _lr_config(tmp_path)
    points = parse_grid("train.lr=" + ",".join(FLOAT_FORMS))
    assert [p.overrides["train.lr"] for p in points] == FLOAT_FORMS  # passed on as text, as written
    for point, text in zip(points, FLOAT_FORMS, strict=True):
        job = load(base, point.args)  # what tools/pretrain.py does with the point's arguments
        assert type(job.train.lr) is float and job.train.lr == float(text), point.args


def test_float_spellings_through_a_sweep_list(tmp_path):
    base = _lr_config(tmp_path)
    listing = tmp_path / "points.yaml"
    listing.write_text("".join(f"- {{train.lr: {text}}}\n" for text in FLOAT_FORMS))
    points = load_list(listing)
    assert [p.overrides["train.lr"] for p in points] == FLOAT_FORMS
    for point, text in zip(points, FLOAT_FORMS, strict=True):
        assert load(base, point.args).train.lr == float(text), point.args


@pytest.mark.parametrize("text", NEGATIVE_FORMS)
def test_negative_spellings_reach_validation_as_numbers(tmp_path, text):
    # Read as a string the message would be "must be a number"; read as a number, validation quotes it.
    expected = f"train.lr must be positive; got {float(text)}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(None, [f"train.lr={text}"])
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(_lr_config(tmp_path, text))


def test_an_int_is_accepted_for_a_float_field():
    job = load(None, ["train.lr=2", "train.min_lr=0"])
    assert type(job.train.lr) is float and job.train.lr == 2.0


@pytest.mark.parametrize("text", ["1e-3", "007", "2024-01-01", "1_000", "0x10", "1.5E3"])
def test_a_string_field_takes_a_number_as_written(tmp_path, text):
    assert load(None, [f"output_dir={text}"]).output_dir == text
    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {text}\ndata:\n  prefixes: [{text}, corpus_{text}]\n")
    job = load(path)
    assert job.output_dir == text and job.data.prefixes == [text, f"corpus_{text}"]


def test_a_string_field_in_a_sweep_list_takes_a_number_as_written(tmp_path):
    listing = tmp_path / "points.yaml"
    listing.write_text(
        "- {data.cache_dir: 1e-3, data.prefixes: [2.0e3, 'x y'], logging.profile_steps: [3, 4]}\n"
    )
    point = load_list(listing)[0]
    job = load(None, point.args)
    assert job.data.cache_dir == "1e-3" and job.data.prefixes == ["2.0e3", "x y"]
    assert job.logging.profile_steps == [3, 4]


def test_a_string_field_refuses_true_and_null():
    with pytest.raises(ConfigError, match=r"output_dir must be a string; got True \(quote it\)"):
        load(None, ["output_dir=true"])
    with pytest.raises(ConfigError, match="output_dir must be a string; got None"):
        load(None, ["output_dir=null"])


def test_a_quoted_number_is_accepted_for_a_number_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text('train:\n  lr: \'1e-3\'\n  steps: "20"\n  min_lr: "0"\n')
    job = load(path)
    assert (job.train.lr, job.train.steps, job.train.min_lr) == (1e-3, 20, 0.0)
    assert type(job.train.steps) is int and type(job.train.lr) is float
    assert load(None, ['train.lr="3E-4"']).train.lr == 3e-4


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=fast", "train.lr must be a number; got 'fast'"),
        ("train.lr=inf", "train.lr must be a number; got 'inf'"),  # YAML spells infinity .inf
        ("train.lr='1e-3x'", "train.lr must be a number; got '1e-3x'"),
        ("train.lr=.inf", "train.lr must be a finite number; got .inf"),
        ("train.lr=-.inf", "train.lr must be a finite number; got -.inf"),
        ("train.lr=.nan", "train.lr must be a finite number; got .nan"),
        ("train.lr=1e400", "train.lr must be a finite number; got 1e400"),
        ("train.hang_timeout_s=.inf", "train.hang_timeout_s must be a finite number; got .inf"),
        ("logging.peak_tflops=.nan", "logging.peak_tflops must be a finite number; got .nan"),
        ("train.lr=1" + "0" * 400, "train.lr must be a finite number"),
        ("data.weights=[1,.nan]", r"data.weights\[1\] must be a finite number; got .nan"),
    ],
)
def test_bad_numbers_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [override])


@pytest.mark.parametrize("text, expected", [("1e4", 10000), ("2.0", 2), ("1.5E3", 1500), ("'1e4'", 10000)])
def test_an_int_field_takes_a_whole_float(text, expected):
    job = load(None, [f"train.steps={text}"])
    assert type(job.train.steps) is int and job.train.steps == expected


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_layers=2.5", "model.num_layers must be an integer; got 2.5, which is not a whole number"),
        ("train.steps=1e-3", "train.steps must be an integer; got 1e-3, which is not a whole number"),
        (
            "train.steps=1e17",
            r"train.steps must be an integer; got 1e17, which is not a whole number of at most",
        ),
        ("train.steps=.inf", "train.steps must be an integer; got .inf"),
        ("train.steps=two", "train.steps must be an integer; got 'two'"),
        ("parallel.dp=1.5", "parallel.dp must be an integer; got 1.5"),
    ],
)
def test_an_int_field_refuses_fractions_and_inexact_floats(override, message):
    with pytest.raises(ConfigError, match=message):
        load(None, [override])


def test_the_largest_exact_whole_float_is_accepted():
    assert load(None, ["train.steps=9.007199254740992e15"]).train.steps == 2**53


def test_loaded_configs_hold_plain_values_that_dump_and_reload(tmp_path):
    job = load(None, ["output_dir=1e-3", "train.lr=3E-4", "train.steps=1e3", "data.cache_dir=007"])
    raw = to_dict(job)
    assert yaml.safe_load(yaml.safe_dump(raw)) == raw  # plain int/float/str: PyYAML's own dumper takes them
    dump(job, tmp_path / "job.yaml")
    assert load(tmp_path / "job.yaml") == job
    # The dump quotes the string 1e-3, so even a YAML 1.1 reader sees a string.
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["output_dir"] == "1e-3"


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1e-3\n")
    message = (
        r"broken.yaml is not valid YAML at line 3, column 1: expected ',' or '\]', but got '<stream end>'"
    )
    with pytest.raises(ConfigError, match=message):
        load(path)


# --- the loader against references -------------------------------------------------------------------------

# YAML 1.2.2, 10.3.2 (core schema): the plain scalars that resolve to floats and to ints.
SPEC_FLOAT = r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?"
SPEC_INT = r"[-+]?[0-9]+"


@settings(max_examples=100, deadline=None)
@given(st.from_regex(SPEC_FLOAT, fullmatch=True).filter(lambda s: not re.fullmatch(SPEC_INT, s)))
def test_every_yaml_1_2_float_reads_as_pythons_float(text):
    value = load_yaml(text)
    assert type(value) is float and (value == float(text)), text


@pytest.mark.parametrize("text", [".inf", "+.inf", "-.Inf", ".INF"])
def test_yaml_infinities(text):
    assert load_yaml(text) == (-math.inf if text.startswith("-") else math.inf)


def _read(loader, text):
    try:
        value = loader(text)
    except (yaml.YAMLError, ValueError) as err:
        return type(err)
    return "nan" if isinstance(value, float) and math.isnan(value) else (type(value), value)


# Every pattern by which YAML 1.1 (PyYAML's SafeLoader) gives a plain scalar a type other than str.
_YAML_1_1_PATTERNS = sorted(
    {
        regexp.pattern
        for resolvers in yaml.SafeLoader.yaml_implicit_resolvers.values()
        for tag, regexp in resolvers
        if tag.rsplit(":", 1)[-1] in ("bool", "float", "int", "null")
    }
)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(_YAML_1_1_PATTERNS).flatmap(lambda p: st.from_regex(re.compile(p, re.X), fullmatch=True))
)
def test_every_value_yaml_1_1_typed_reads_the_same(text):
    assert _read(load_yaml, text) == _read(yaml.safe_load, text), text


def test_dates_stay_strings_and_dumps_quote_float_like_strings():
    assert yaml.safe_load("2024-01-01") != "2024-01-01"  # YAML 1.1 reads a date
    assert load_yaml("2024-01-01") == "2024-01-01"
    for text in ["1e-3", "-.5", "1E3", "2024-01-01", "1.5", "12"]:
        dumped = dump_yaml({"name": text})
        assert load_yaml(dumped) == {"name": text} and yaml.safe_load(dumped) == {"name": text}, dumped


# --- ranges every field obeys (validate._check_ranges), and the defects the fuzz (test_fuzz.py) found -------


@pytest.mark.parametrize(
    "overrides, message",
    [
        # used to end in a NumPy traceback (no micro-batches to stack)
        (
            ["train.global_batch_size=0", "train.micro_batch_size=1"],
            "train.global_batch_size must be at least 1; got 0",
        ),
        (["train.seed=-1"], "train.seed must be >= 0; got -1"),  # used to fail in NumPy's PCG64
        (
            ["train.seed=9223372036854775808"],
            r"train.seed must be at most 2\*\*63-1; got 9223372036854775808",
        ),
        (["model.num_kv_heads=0"], "model.num_kv_heads must be at least 1; got 0"),  # used to mean null
        (["model.head_dim=-2"], "model.head_dim must be at least 1; got -2"),
        (["train.eval_batches=0"], "train.eval_batches must be at least 1; got 0"),
        (["train.adam_eps=0"], "train.adam_eps must be positive; got 0.0"),
        (["train.adam_beta2=1"], r"train.adam_beta2 must be in \[0, 1\); got 1.0"),
        (["logging.profile_steps=[-1, 2]"], r"logging.profile_steps\[0\] must be >= 0; got -1"),
        (
            ["output_dir="],
            r"output_dir is empty; give a value or leave output_dir out \(default: 'runs/default'\)",
        ),
        (
            ["checkpoint.load=''"],
            r"checkpoint.load is empty; give a value or leave checkpoint.load out \(default: null\)",
        ),
        (["data.prefixes=['']", "data.tokenizer=t"], r"data.prefixes\[0\] is empty; give a value$"),
        (["data.split=inf,1,0"], "data.split must be three non-negative"),
        (
            ["data.split=100,0,0", "train.eval_interval=5"],
            "data.split='100,0,0' gives the valid split no share",
        ),
        (
            ["model.arch=llama", "model.head_dim=5"],
            r"model.arch=llama \(rotary embeddings\) needs an even head size",
        ),
    ],
)
def test_out_of_range_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


def test_zero_keeps_its_off_meaning_where_documented():
    job = load(
        None, ["checkpoint.interval=0", "train.eval_interval=0", "data.split=100,0,0", "train.grad_clip=0"]
    )
    assert (job.checkpoint.interval, job.train.eval_interval, job.train.grad_clip) == (0, 0, 0.0)
