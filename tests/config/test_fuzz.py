"""Bad input, fuzzed: every invalid config or override is refused by tools/pretrain.py with one line that
names the field, exit status 2, no traceback and nothing written (issue 20, point 8).

The invalid values are derived from the schema's annotations (llmtrain/config/schema.py), not from a list of
fields, so a field added later is fuzzed as well: each field gets values of every wrong type and negative
numbers. What the annotations cannot say (a count must be at least 1, a probability below 1, the degrees must
divide the model, a file must exist) is written out here from the fields' documented meaning.

Most cases run in-process through the tool's own entry point (`run_tool(main, argv)`, which a command-line
run calls too), a sample as real processes. Every field also gets one fixed wrong type (and, for a number,
one negative value) outside the random draws, so that none depends on the draw. Each case gets an output_dir
and a data.cache_dir in a fresh directory, and a fresh working directory; all three must still be absent or
empty afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Union
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtrain.cli import run_tool
from llmtrain.config import JobConfig
from llmtrain.config.loader import load_yaml
from llmtrain.config.validate import _POSITIVE

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "tools" / "pretrain.py"
CONFIG = ROOT / "configs" / "ernie.yaml"


def _pretrain_main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("pretrain_tool", PRETRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


PRETRAIN_MAIN = _pretrain_main()

# A tiny valid job (dotted path -> YAML text): a case changes one or a few of these. A case accepted by
# mistake stops in-process before its first write (see run_in_process); as a process it would train a step.
BASE = {
    "model.num_layers": "2",
    "model.hidden_size": "64",
    "model.num_attention_heads": "4",
    "model.num_kv_heads": "2",
    "model.ffn_hidden_size": "128",
    "model.seq_length": "32",
    "train.steps": "1",
    "train.global_batch_size": "8",
    "train.micro_batch_size": "2",
    "train.warmup_steps": "0",
    "train.eval_interval": "0",
    "logging.tensorboard": "false",
}

FUZZ = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# --- the schema, read from the annotations ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One config field that holds a value (not a section)."""

    path: str
    kind: Any
    """The annotation without its None: int, float, bool, str, a Literal or list[...]."""
    optional: bool


def _leaves(cls: type, prefix: str = "") -> list[Leaf]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")
            continue
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
        kinds = [a for a in args if a is not type(None)] if optional else [hint]
        assert len(kinds) == 1, f"{prefix}{f.name}: the fuzz knows no union of {kinds}"
        out.append(Leaf(f"{prefix}{f.name}", kinds[0], optional))
    return out


LEAVES = _leaves(JobConfig)
SECTIONS = sorted({leaf.path.split(".")[0] for leaf in LEAVES if "." in leaf.path})
NUMBER_LEAVES = [leaf for leaf in LEAVES if leaf.kind in (int, float)]


def _reads_as_str(text: str) -> bool:
    try:
        return type(load_yaml(text)) is str
    except Exception:  # noqa: BLE001 - any text YAML cannot read is not a plain word
        return False


WORDS = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,11}", fullmatch=True).filter(_reads_as_str)
BOOLS = st.sampled_from(["true", "false", "True", "yes", "off"])  # YAML 1.1 booleans
NULLS = st.sampled_from(["null", "~", "Null"])
INTS = st.integers(-(10**6), 10**6).map(str)
FRACTIONS = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()).map(repr)
NON_FINITE = st.sampled_from([".nan", ".inf", "-.inf", "1e400", "-1e400"])
# Whole numbers past what torch and numpy hold in an int64 (seeds, step counts and sizes end up there).
TOO_BIG_INTS = st.integers(2**63, 2**200).map(str)
LISTS = st.lists(st.integers(0, 9), max_size=3).map(lambda xs: "[" + ", ".join(map(str, xs)) + "]")
MAPPINGS = st.builds(lambda k, v: f"{{{k}: {v}}}", WORDS, st.integers(0, 9))
NEGATIVE_INTS = st.integers(-(2**62), -1).map(str)
NEGATIVE_FLOATS = st.floats(max_value=-1e-300, allow_nan=False, allow_infinity=False).map(repr)


def _wrong_scalar(kind: Any) -> st.SearchStrategy[str]:
    """YAML texts that are not a value of the scalar type `kind` (int, float, bool, str or a Literal)."""
    if typing.get_origin(kind) is Literal:
        choices = {str(c) for c in typing.get_args(kind)}
        near = st.sampled_from(sorted(choices)).map(lambda c: c.upper() + "x")
        return st.one_of(WORDS.filter(lambda w: w not in choices), near, BOOLS, INTS, LISTS, MAPPINGS)
    if kind is int:
        return st.one_of(WORDS, BOOLS, FRACTIONS, NON_FINITE, TOO_BIG_INTS, LISTS, MAPPINGS)
    if kind is float:
        return st.one_of(WORDS, BOOLS, NON_FINITE, LISTS, MAPPINGS)
    if kind is bool:
        return st.one_of(WORDS, INTS, FRACTIONS, LISTS, MAPPINGS)
    if kind is str:
        return st.one_of(BOOLS, LISTS, MAPPINGS, st.sampled_from(["''", '""']))
    raise AssertionError(f"the fuzz knows no field type {kind!r}")


def wrong_value(leaf: Leaf) -> st.SearchStrategy[str]:
    """YAML texts that `leaf` refuses whatever the field means: wrong types, and nulls where not allowed."""
    kind = leaf.kind
    nulls = [] if leaf.optional else [NULLS]
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        wrong_items = st.lists(_wrong_scalar(item), min_size=1, max_size=3).map(
            lambda xs: f"[{', '.join(xs)}]"
        )
        scalars = st.one_of(INTS, BOOLS, MAPPINGS) if item is str else st.one_of(WORDS, INTS, BOOLS, MAPPINGS)
        return st.one_of(scalars, wrong_items, *nulls)
    return st.one_of(_wrong_scalar(kind), *nulls)


def negative_value(leaf: Leaf) -> st.SearchStrategy[str]:
    """No count, size, rate or time in a job is negative."""
    return NEGATIVE_INTS if leaf.kind is int else st.one_of(NEGATIVE_INTS, NEGATIVE_FLOATS)


# --- running the tool ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One invalid input: config values (dotted path -> YAML text) given as overrides or in a YAML file."""

    values: dict[str, str]
    names: tuple[str, ...]
    """The message must contain one of these (the offending field, or the file at fault)."""
    in_file: bool = False
    config: str | None = None
    """--config, when not the generated file or configs/ernie.yaml (a missing file, a malformed one)."""
    file_text: bytes | None = None
    """The whole --config file, verbatim (malformed YAML); the values then go on the command line."""
    extra: tuple[str, ...] = ()
    """Raw arguments after the overrides (an override that is not key=value)."""


def _yaml_text(values: dict[str, str]) -> str:
    tree: dict[str, Any] = {}
    for path, text in values.items():
        *sections, key = path.split(".")
        node = tree
        for section in sections:
            if not isinstance(node.get(section), dict):  # a case's key below a field replaces the field
                node[section] = {}
            node = node[section]
        node[key] = text

    def lines(node: dict[str, Any], indent: str) -> Iterator[str]:
        for key, value in node.items():
            if isinstance(value, dict):
                yield f"{indent}{key}:"
                yield from lines(value, indent + "  ")
            else:
                yield f"{indent}{key}: {value}"

    return "\n".join(lines(tree, "")) + "\n"


def command_line(case: Case, work: Path) -> list[str]:
    """tools/pretrain.py's arguments for `case`, its outputs in work/out and work/cache ("{work}" in a value
    or in --config stands for that directory)."""
    values = {
        **BASE,
        "output_dir": str(work / "out"),
        "data.cache_dir": str(work / "cache"),
        **{path: text.replace("{work}", str(work)) for path, text in case.values.items()},
    }
    config = (case.config or "").replace("{work}", str(work)) or str(CONFIG)
    if case.file_text is not None:
        config = str(work / "job.yaml")
        Path(config).write_bytes(case.file_text)
    elif case.in_file:
        config = str(work / "job.yaml")
        Path(config).write_text(_yaml_text(values))
        return ["--config", config]
    return ["--config", config, *[f"{path}={text}" for path, text in values.items()], *case.extra]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@contextlib.contextmanager
def _process_state(cwd: Path) -> Iterator[None]:
    """The working directory, argv[0] (which run_tool prints as the tool's name) and the process-wide state
    a launch may set, restored afterwards."""
    saved = (os.getcwd(), sys.argv, sys.excepthook, torch.get_num_threads())
    saved_env = {k: os.environ.pop(k) for k in ("LLMTRAIN_DEBUG", "LLMTRAIN_FAULTS") if k in os.environ}
    os.chdir(cwd)
    sys.argv = [str(PRETRAIN)]
    try:
        yield
    finally:
        os.chdir(saved[0])
        sys.argv, sys.excepthook = saved[1], saved[2]
        torch.set_num_threads(saved[3])
        os.environ.update(saved_env)


def _accepted(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("the tool accepted the config: it got as far as its first write")


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python tools/pretrain.py *argv`, run in this process.

    A config accepted by mistake stops with an AssertionError instead of training: where the built-in corpus
    is prepared (after its name is checked) and where the launch is committed to output_dir.
    """
    out, err = io.StringIO(), io.StringIO()
    stops = (
        mock.patch("llmtrain.data.corpus.stdlib_files", _accepted),
        mock.patch("llmtrain.training.run._commit", _accepted),
    )
    with (
        _process_state(cwd),
        stops[0],
        stops[1],
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            run_tool(PRETRAIN_MAIN, argv)
        except SystemExit as stop:
            code = stop.code
        else:
            raise AssertionError("run_tool returned instead of exiting")
    assert isinstance(code, int), code
    return code, out.getvalue(), err.getvalue()


def run_as_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """The same as a real process, as a user starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLMTRAIN_DEBUG", "LLMTRAIN_FAULTS")}
    result = subprocess.run(
        [sys.executable, str(PRETRAIN), *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )
    return result.returncode, result.stdout, result.stderr


def expect_refused(
    case: Case, prepare: Callable[[Path], None] | None = None, runner: Callable = run_in_process
) -> str:
    """Run `case` in a fresh directory and check the refusal; returns the message."""
    with tempfile.TemporaryDirectory() as tmp:
        work, cwd = Path(tmp) / "work", Path(tmp) / "cwd"
        work.mkdir()
        cwd.mkdir()
        if prepare is not None:
            prepare(work)
        argv = command_line(case, work)
        before = _files(work)
        code, stdout, stderr = runner(argv, cwd)
        shown = f"argv: {argv}\nexit {code}\nstdout: {stdout!r}\nstderr: {stderr!r}"
        assert code == 2, shown
        assert "Traceback" not in stderr and stdout == "", shown
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain: error: "), shown
        names = [name.replace("{work}", str(work)) for name in case.names]
        assert any(name in lines[0] for name in names), f"names none of {names}\n{shown}"
        assert _files(work) == before, f"files written: {sorted(_files(work) - before)}\n{shown}"
        assert not (work / "out").exists() and not (work / "cache").exists(), shown
        assert list(cwd.iterdir()) == [], f"cwd changed: {list(cwd.iterdir())}\n{shown}"
        return lines[0]


def fuzz(
    strategy: st.SearchStrategy[Case], examples: int, prepare: Callable[[Path], None] | None = None
) -> int:
    """Check `examples` cases drawn from `strategy`; returns how many ran (hypothesis may run fewer when the
    strategy has fewer distinct cases, which the callers' counts catch)."""
    ran = []

    @settings(max_examples=examples, **FUZZ)
    @given(strategy)
    def check(case: Case) -> None:
        ran.append(case)
        expect_refused(case, prepare)

    check()
    return len(ran)


# --- wrong types and out-of-range values, for every field ---------------------------------------------------


@st.composite
def wrong_types(draw: st.DrawFn) -> Case:
    leaf = draw(st.sampled_from(LEAVES))
    text = draw(wrong_value(leaf))
    return Case({leaf.path: text}, (leaf.path,), in_file=draw(st.booleans()))


@st.composite
def sections_as_values(draw: st.DrawFn) -> Case:
    section = draw(st.sampled_from(SECTIONS))
    text = draw(st.one_of(WORDS, INTS, BOOLS, LISTS))
    if draw(st.booleans()):  # in a file the section's keys are replaced by the value
        values = {k: v for k, v in BASE.items() if not k.startswith(f"{section}.")}
        if section == "data":
            values["data.cache_dir"] = text
        return Case({**values, section: text}, (section,), in_file=True)
    return Case({section: text}, (section,))


@st.composite
def negative_numbers(draw: st.DrawFn) -> Case:
    leaf = draw(st.sampled_from(NUMBER_LEAVES))
    return Case({leaf.path: draw(negative_value(leaf))}, (leaf.path,), in_file=draw(st.booleans()))


# Fields whose 0 is out of range, by their documented meaning: counts of at least 1, sizes, rates and times
# that must be positive. (Fields where 0 means "off" or "default", such as checkpoint.interval, are not here.)
ZERO_REFUSED = [
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.seq_length",
    "model.max_position_embeddings",
    "model.norm_eps",
    "model.rope_theta",
    "parallel.tp",
    "parallel.pp",
    "parallel.dp",
    "parallel.dp_shard",
    "parallel.virtual_stages",
    "parallel.dp_bucket_mb",
    "train.steps",
    "train.lr",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.adam_eps",
    "train.initial_loss_scale",
    "train.eval_batches",
    "train.max_bad_steps",
    "train.loss_spike_window",
    "train.hang_timeout_s",
    "checkpoint.keep",
    "logging.interval",
    "logging.peak_tflops",
]
# Fields with an upper bound: probabilities and Adam's betas lie below 1; ZeRO has stages 0 to 3.
AT_LEAST_REFUSED = {
    "model.hidden_dropout": 1.0,
    "model.attention_dropout": 1.0,
    "train.adam_beta1": 1.0,
    "train.adam_beta2": 1.0,
    "parallel.zero_stage": 4,
}


@st.composite
def out_of_range(draw: st.DrawFn) -> Case:
    if draw(st.booleans()):
        path = draw(st.sampled_from(ZERO_REFUSED))
        text = draw(st.sampled_from(["0", "0.0", "-0", "0e0"]))
        if path == "train.global_batch_size":
            return Case({path: text, "train.micro_batch_size": "1"}, (path,))
        return Case({path: text}, (path,), in_file=draw(st.booleans()))
    path, bound = draw(st.sampled_from(sorted(AT_LEAST_REFUSED.items())))
    if isinstance(bound, int):
        text = str(draw(st.integers(bound, 2**40)))
    else:
        text = repr(draw(st.floats(bound, 1e12)))
    return Case({path: text}, (path,), in_file=draw(st.booleans()))


@pytest.mark.slow  # multi-second (6 s on two idle cores): runs in CI, not in -m 'not slow'
def test_wrong_types_for_every_field():
    assert fuzz(st.one_of(wrong_types(), sections_as_values()), 200) >= 200


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_out_of_range_values():
    assert fuzz(st.one_of(negative_numbers(), out_of_range()), 120) >= 120


def test_the_fuzz_covers_every_field_type():
    kinds = {typing.get_origin(leaf.kind) or leaf.kind for leaf in LEAVES}
    assert kinds <= {int, float, bool, str, Literal, list}, kinds
    hints = typing.get_type_hints(JobConfig)
    assert SECTIONS == sorted(name for name, hint in hints.items() if dataclasses.is_dataclass(hint))


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.path)
def test_every_field_refuses_a_mapping(leaf):
    expect_refused(Case({leaf.path: "{a: 1}"}, (leaf.path,)))


@pytest.mark.parametrize("leaf", NUMBER_LEAVES, ids=lambda leaf: leaf.path)
def test_every_number_field_refuses_a_negative_value(leaf):
    expect_refused(Case({leaf.path: "-1"}, (leaf.path,), in_file=True))


# --- incompatible values ------------------------------------------------------------------------------------


@st.composite
def incompatible(draw: st.DrawFn) -> Case:
    heads = draw(st.integers(1, 16))
    shape = {
        "model.num_attention_heads": str(heads),
        "model.num_kv_heads": str(heads),
        "model.hidden_size": str(heads * 16),
        "model.ffn_hidden_size": "128",
    }
    rule = draw(st.integers(0, 17))
    if rule == 0:  # a TP degree that does not divide the heads
        tp = draw(st.integers(2, 64).filter(lambda t: heads % t))
        return Case({**shape, "parallel.tp": str(tp)}, ("parallel.tp",))
    if rule == 1:  # kv heads that do not divide the heads
        kv = draw(st.integers(2, 32).filter(lambda k: heads % k))
        return Case({**shape, "model.num_kv_heads": str(kv)}, ("model.num_kv_heads",))
    if rule == 2:  # a hidden size the heads do not divide
        hidden = draw(st.integers(heads + 1, 1024).filter(lambda h: h % heads)) if heads > 1 else None
        if hidden is None:
            return Case({**shape, "parallel.tp": "3"}, ("parallel.tp",))
        return Case({**shape, "model.hidden_size": str(hidden)}, ("model.hidden_size",))
    if rule == 3:  # an odd head size under rotary embeddings
        arch = draw(st.sampled_from(["llama", "ernie"]))
        head_dim = draw(st.integers(0, 100).map(lambda k: 2 * k + 1))
        return Case({"model.arch": arch, "model.head_dim": str(head_dim)}, ("model.head_dim",))
    if rule == 4:  # more pipeline stages than layers
        layers = draw(st.integers(1, 8))
        pp = draw(st.integers(layers + 1, 64))
        return Case({"model.num_layers": str(layers), "parallel.pp": str(pp)}, ("parallel.pp",))
    if rule == 5:  # more model chunks than layers
        pp, chunks = draw(st.integers(2, 4)), draw(st.integers(2, 4))
        layers = draw(st.integers(1, pp * chunks - 1))
        values = {
            "model.num_layers": str(layers),
            "parallel.pp": str(pp),
            "parallel.virtual_stages": str(chunks),
        }
        return Case({**values, "parallel.schedule": "interleaved_1f1b"}, ("parallel.virtual_stages",))
    if rule == 6:  # an interleaved schedule on one stage, or virtual stages without one
        if draw(st.booleans()):
            return Case({"parallel.schedule": "interleaved_1f1b", "parallel.pp": "1"}, ("parallel.schedule",))
        schedule = draw(st.sampled_from(["gpipe", "1f1b", "zb_h1"]))
        values = {"parallel.schedule": schedule, "parallel.virtual_stages": str(draw(st.integers(2, 8)))}
        return Case(values, ("parallel.virtual_stages",))
    if rule == 7:  # a global batch that the micro batch does not divide
        micro = draw(st.integers(2, 64))
        batch = draw(st.integers(1, 1024).filter(lambda b: b % micro))
        values = {"train.global_batch_size": str(batch), "train.micro_batch_size": str(micro)}
        return Case(values, ("train.global_batch_size",))
    if rule == 8:  # degrees that do not multiply out to the world size (1 process)
        degrees = {
            "parallel.tp": draw(st.sampled_from(["1", "2", "4"])),
            "parallel.pp": draw(st.sampled_from(["1", "2"])),
        }
        if degrees == {"parallel.tp": "1", "parallel.pp": "1"} or draw(st.booleans()):
            degrees["parallel.dp"] = str(draw(st.integers(2, 1024)))
            return Case(
                {
                    **shape,
                    "model.num_attention_heads": "4",
                    "model.num_kv_heads": "2",
                    "model.hidden_size": "64",
                    **degrees,
                },
                ("parallel.dp",),
            )
        return Case(
            {"model.num_attention_heads": "4", "model.num_kv_heads": "2", **degrees}, ("parallel.tp",)
        )
    if rule == 9:  # a sequence longer than the positions
        seq = draw(st.integers(2, 4096))
        values = {
            "model.seq_length": str(seq),
            "model.max_position_embeddings": str(draw(st.integers(1, seq - 1))),
        }
        return Case(values, ("model.max_position_embeddings",))
    if rule == 10:  # a floor above the peak learning rate
        lr = draw(st.floats(1e-6, 1.0))
        return Case(
            {"train.lr": repr(lr), "train.min_lr": repr(lr * draw(st.floats(1.01, 100.0)))}, ("train.min_lr",)
        )
    if rule == 11:  # a profile range that is not [first, last]
        steps = draw(
            st.one_of(
                st.lists(st.integers(0, 99), min_size=1, max_size=1),
                st.lists(st.integers(0, 99), min_size=3, max_size=5),
            )
        )
        if draw(st.booleans()):
            first = draw(st.integers(1, 99))
            steps = [first, draw(st.integers(0, first - 1))]
        return Case({"logging.profile_steps": str(steps)}, ("logging.profile_steps",))
    if rule == 12:  # blend weights that do not match the prefixes
        weights = draw(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=4))
        prefixes = [f"p{i}" for i in range(draw(st.integers(0, 4).filter(lambda n: n != len(weights))))]
        values = {"data.weights": str(weights), "data.prefixes": "[" + ", ".join(prefixes) + "]"}
        return Case(values, ("data.weights",))
    if rule == 13:  # a split that is not three proportions, or leaves nothing to train on
        split = draw(
            st.one_of(
                st.lists(st.integers(0, 99), min_size=1, max_size=5)
                .filter(lambda s: len(s) != 3)
                .map(lambda s: ",".join(map(str, s))),
                st.sampled_from(
                    ["0,1,1", "-1,2,0", "a,b,c", "nan,1,0", "inf,1,0", "98,2", "98;2;0", "1e400,1,0"]
                ),
            )
        )
        return Case({"data.split": split}, ("data.split",))
    if rule == 14:  # evaluation asked for but no valid share
        return Case(
            {
                "data.split": f"{draw(st.integers(1, 100))},0,{draw(st.integers(0, 5))}",
                "train.eval_interval": str(draw(st.integers(1, 100))),
            },
            ("data.split",),
        )
    if rule == 15:  # a rank order or backend that does not exist
        if draw(st.booleans()):
            order = draw(
                st.lists(st.sampled_from(["tp", "dp", "pp", "ep", "cp"]), max_size=4)
                .map("-".join)
                .filter(lambda o: sorted(o.split("-")) not in (["dp", "pp", "tp"], ["cp", "dp", "pp", "tp"]))
                .filter(_reads_as_str)
            )
            return Case({"parallel.order": order}, ("parallel.order",))
        backend = draw(WORDS.filter(lambda w: w not in ("auto", "gloo", "nccl")))
        return Case({"parallel.backend": backend}, ("parallel.backend",))
    if rule == 16:  # a corpus that is not built in
        return Case({"data.corpus": draw(WORDS.filter(lambda w: w != "stdlib"))}, ("data.corpus",))
    # a sequence that the TP degree does not divide, under sequence parallelism
    seq = draw(st.integers(3, 999).map(lambda s: 2 * s + 1))
    values = {"parallel.tp": "2", "parallel.sequence_parallel": "true", "model.seq_length": str(seq)}
    return Case(
        {
            **shape,
            "model.num_attention_heads": "4",
            "model.num_kv_heads": "2",
            "model.hidden_size": "64",
            **values,
        },
        ("parallel.sequence_parallel",),
    )


def test_incompatible_values():
    assert fuzz(incompatible(), 80) >= 80


# --- unknown keys -------------------------------------------------------------------------------------------


def _typos(name: str) -> st.SearchStrategy[str]:
    """Misspellings of `name`: a letter dropped, doubled, swapped or changed, a suffix, another case."""
    n = len(name)
    return st.one_of(
        st.integers(0, n - 1).map(lambda i: name[:i] + name[i + 1 :]),
        st.integers(0, n - 1).map(lambda i: name[:i] + name[i] + name[i:]),
        st.integers(0, max(0, n - 2)).map(
            lambda i: name[:i] + name[i + 1 : i + 2] + name[i : i + 1] + name[i + 2 :]
        ),
        st.tuples(st.integers(0, n - 1), st.sampled_from("aeiouxz_")).map(
            lambda t: name[: t[0]] + t[1] + name[t[0] + 1 :]
        ),
        st.sampled_from(["s", "_size", "2", "_"]).map(lambda suffix: name + suffix),
        st.just(name.upper()),
    )


def _names_at(prefix: str) -> set[str]:
    """The field and section names valid right below dotted `prefix` ("" for the top level)."""
    depth = prefix.count(".") + 1 if prefix else 0
    return {
        leaf.path.split(".")[depth] for leaf in LEAVES if leaf.path.startswith(prefix + "." if prefix else "")
    }


@st.composite
def unknown_keys(draw: st.DrawFn) -> Case:
    leaf = draw(st.sampled_from(LEAVES))
    parts = leaf.path.split(".")
    value = draw(st.sampled_from(["1", "true", "x", "[1]"]))
    in_file = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:  # a key below a field, as if the field were a section
        return Case({f"{leaf.path}.{draw(WORDS)}": value}, (leaf.path,), in_file=in_file)
    depth = draw(st.integers(0, len(parts) - 1))
    prefix = ".".join(parts[:depth])
    valid = _names_at(prefix)
    wrong = draw(st.one_of(_typos(parts[depth]), WORDS).filter(lambda w: w not in valid and _reads_as_str(w)))
    path = ".".join([*parts[:depth], wrong, *parts[depth + 1 :]])
    named = ".".join([*parts[:depth], wrong])
    if in_file and any(path.startswith(k + ".") or k.startswith(path + ".") for k in BASE):
        in_file = False  # the file would hold both a value and a section under one key
    return Case({path: value}, (named,), in_file=in_file)


def test_unknown_keys():
    assert fuzz(unknown_keys(), 80) >= 80


# --- missing files and malformed YAML -----------------------------------------------------------------------


def _tokenizer(work: Path) -> None:
    """A real, tiny Hugging Face tokenizer at work/tok (so that only the data prefix is missing)."""
    from tokenizers import Tokenizer, models

    (work / "tok").mkdir()
    vocab = {"<unk>": 0, "</s>": 1, "a": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(work / "tok" / "tokenizer.json"))
    (work / "a_file").write_text("not a checkpoint, tokenizer or directory\n")
    (work / "empty_dir").mkdir()


FILE_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,15}(\.[a-z]{1,5})?", fullmatch=True)


@st.composite
def missing_files(draw: st.DrawFn) -> Case:
    """Paths to what does not exist, or exists as the wrong kind of thing (made by _tokenizer in {work})."""
    name = draw(FILE_NAMES)
    work = "{work}"  # filled in by command_line_for, which knows the case's directory
    gone = f"{work}/missing/{name}"
    rule = draw(st.integers(0, 6))
    if rule == 0:
        return Case(
            {"data.tokenizer": draw(st.sampled_from([gone, f"{work}/empty_dir", f"{work}/a_file"]))},
            ("data.tokenizer",),
        )
    if rule == 1:
        prefixes = [f"{work}/missing/{draw(FILE_NAMES)}" for _ in range(draw(st.integers(1, 3)))]
        return Case(
            {"data.tokenizer": f"{work}/tok", "data.prefixes": "[" + ", ".join(prefixes) + "]"},
            ("data.prefixes",),
        )
    if rule == 2:
        return Case(
            {"checkpoint.load": draw(st.sampled_from([gone, f"{work}/empty_dir", f"{work}/a_file"]))},
            ("checkpoint.load",),
        )
    if rule == 3:
        return Case({"parallel.auto": "true", "parallel.cluster": gone}, ("parallel.cluster",))
    if rule == 4:
        return Case({}, (gone,), config=gone)
    if rule == 5:
        return Case({"output_dir": f"{work}/a_file"}, ("output_dir",))
    return Case({"data.cache_dir": f"{work}/a_file"}, ("data.cache_dir",))


def test_missing_files():
    assert fuzz(missing_files(), 50, prepare=_tokenizer) >= 50


def _yaml_error(text: str) -> bool:
    try:
        load_yaml(text)
    except Exception:  # noqa: BLE001 - PyYAML's errors (scanner, parser, composer) share no narrower base here
        return True
    return False


BROKEN_LINES = [
    "  lr: [1e-3",
    "  lr: {a: 1",
    "  steps: 'unclosed",
    '  steps: "unclosed',
    "\tsteps: 1",
    "  steps: 1: 2",
    "- item",
    "  lr: *undefined_alias",
    "   misindented: 1",
    "train: [",
    "}",
    "@reserved: 1",
    "  `backtick: 1",
    "%YAML 9.9",
]


@st.composite
def malformed_yaml(draw: st.DrawFn) -> Case:
    named = ("{work}/job.yaml",)
    rule = draw(st.integers(0, 3))
    lines = _yaml_text(BASE).splitlines()
    if rule == 0:  # one broken line anywhere in a good file
        at = draw(st.integers(0, len(lines)))
        text = "\n".join([*lines[:at], draw(st.sampled_from(BROKEN_LINES)), *lines[at:]]) + "\n"
        if not _yaml_error(text):
            text += "train: [\n"
        return Case({}, named, file_text=text.encode())
    if rule == 1:  # a good file cut short, then broken
        text = (
            "\n".join(lines[: draw(st.integers(1, len(lines)))]) + "\n" + draw(st.sampled_from(BROKEN_LINES))
        )
        return Case({}, named, file_text=(text if _yaml_error(text) else text + "\n{").encode())
    if rule == 2:  # a top level that is not a mapping
        text = draw(st.one_of(WORDS, INTS, BOOLS, LISTS, st.just("- model: {}\n- train: {}\n")))
        return Case({}, named, file_text=text.encode())
    # not UTF-8: Latin-1 text or random bytes that do not decode
    raw = draw(
        st.one_of(
            st.just("model:\n  arch: \u00e9rnie\n".encode("latin-1")), st.binary(min_size=1, max_size=64)
        )
    )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return Case({}, named, file_text=raw)
    return Case({}, named, file_text=b"\xff\xfe" + raw)


def test_malformed_yaml():
    assert fuzz(malformed_yaml(), 50) >= 50


@st.composite
def not_key_value(draw: st.DrawFn) -> Case:
    key = ".".join(draw(st.lists(WORDS, min_size=1, max_size=3)))
    text = draw(st.sampled_from([key, f"={key}", f" ={key}", f"{key} 3", f"{key}:3"]))
    return Case({}, (text,), extra=(text,))


def test_overrides_that_are_not_key_value():
    assert fuzz(not_key_value(), 20) >= 20


def test_the_hand_written_rules_name_existing_fields():
    paths = {leaf.path for leaf in LEAVES}
    assert set(ZERO_REFUSED) | set(AT_LEAST_REFUSED) <= paths, (
        set(ZERO_REFUSED) | set(AT_LEAST_REFUSED)
    ) - paths
    assert _POSITIVE <= paths, _POSITIVE - paths


# --- a sample as real processes -----------------------------------------------------------------------------

PROCESS_SAMPLE = [
    Case({"train.steps": "2.5"}, ("train.steps",)),
    Case({"train.global_batch_size": "0", "train.micro_batch_size": "1"}, ("train.global_batch_size",)),
    Case({"train.seed": "-1"}, ("train.seed",), in_file=True),
    Case({"train.eval_batches": "0"}, ("train.eval_batches",)),
    Case({"model.num_attention_heads": "4", "parallel.tp": "3"}, ("parallel.tp",)),
    Case({"trian.steps": "3"}, ("trian",)),
    # Refused in llmtrain.training.run, after torch is imported: as the data are built, the latest refusal,
    # after the process group, the watchdog's thread, the excepthook and the launch plan.
    Case({"data.tokenizer": "{work}/missing.model"}, ("data.tokenizer",)),
    Case({}, ("{work}/job.yaml",), file_text=b"train:\n  lr: [1e-3\n"),
    Case({}, ("{work}/nope.yaml",), config="{work}/nope.yaml"),
]


# Refused in llmtrain.training.run too, earlier than the tokenizer above: a world size the degrees do not
# divide (valid config, but not for one process) as the process group is set up, a missing checkpoint.load
# as the launch is planned. Run here, in this process: as processes each would start torch again (~8 CPU-s)
# to show what the tokenizer's process shows of a refusal after the import (one line, exit 2, nothing
# written, no traceback at exit).
REFUSED_IN_RUN = [
    Case({"parallel.tp": "2"}, ("parallel.tp",)),
    Case({"checkpoint.load": "{work}/missing"}, ("checkpoint.load",)),
]


@pytest.mark.parametrize("case", REFUSED_IN_RUN, ids=lambda c: ",".join(c.values))
def test_refusals_in_the_run(case):
    expect_refused(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", PROCESS_SAMPLE, ids=lambda c: ",".join(c.values) or c.names[0].split("/")[-1]
)
def test_a_sample_as_real_processes(case):
    expect_refused(case, runner=run_as_process)
