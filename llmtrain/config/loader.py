"""YAML files and `key.path=value` overrides into a typed, validated JobConfig.

Every YAML llmtrain reads goes through `load_yaml`: PyYAML's safe schema (YAML 1.1) with the float spellings
of YAML 1.2 added. YAML 1.1 reads a float only with a dot and a signed exponent, so `1e-3`, `3E-4`, `1e+3`,
`1.5E3` and `-.5` came back as strings and a float field rejected them; people write all of these. Every
value YAML 1.1 read as a float still is one. Dates are not resolved: no field holds one, and a run called
`2024-01-01` must stay a string. Ints and bools keep YAML 1.1's rules, which existing configs rely on.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig
from llmtrain.config.validate import validate

_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
# The YAML 1.2 floats that YAML 1.1's pattern misses: an exponent without a dot or without a sign
# (1e-3, 1E3, 2.0e3, 1e+3), a signed leading dot (-.5, +.5e-3). Digits may hold YAML 1.1's underscores.
# Plain integers and `inf`/`nan` without the dot stay as YAML 1.1 reads them (int, str).
_MORE_FLOATS = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?)$""",
    re.X,
)


def _resolvers(drop: tuple[str, ...]) -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit resolvers without the tags in `drop`, as a fresh table a subclass may extend."""
    return {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in drop]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's float spellings and without implicit dates (see the module docstring)."""

    yaml_implicit_resolvers = _resolvers(drop=(_TIMESTAMP_TAG,))


Loader.add_implicit_resolver(_FLOAT_TAG, _MORE_FLOATS, list("-+0123456789."))


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes every string `Loader` would read as a float (a run name `1e-3` stays a string).

    It keeps the date resolver, so date-like strings stay quoted for readers that still use YAML 1.1.
    """

    yaml_implicit_resolvers = _resolvers(drop=())


Dumper.add_implicit_resolver(_FLOAT_TAG, _MORE_FLOATS, list("-+0123456789."))


class _SpelledInt(int):
    """An int read from YAML that remembers the text it was written as."""

    spelling: str


class _SpelledFloat(float):
    """A float read from YAML that remembers the text it was written as."""

    spelling: str


def _spelled(cls: type, construct: Any) -> Any:
    def constructor(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        value = cls(construct(loader, node))
        value.spelling = node.value
        return value

    return constructor


class _SpellingLoader(Loader):
    """`Loader` whose numbers also carry their text, so that a string field can take `1e-3` or `007` as
    written instead of as the number's repr."""


_SpellingLoader.add_constructor(_INT_TAG, _spelled(_SpelledInt, yaml.SafeLoader.construct_yaml_int))
_SpellingLoader.add_constructor(_FLOAT_TAG, _spelled(_SpelledFloat, yaml.SafeLoader.construct_yaml_float))
Dumper.add_representer(_SpelledInt, yaml.SafeDumper.represent_int)
Dumper.add_representer(_SpelledFloat, yaml.SafeDumper.represent_float)


def load_yaml(text: str, *, keep_spelling: bool = False) -> Any:
    """Parse YAML text as every llmtrain reader does (module docstring); raises yaml.YAMLError.

    With `keep_spelling`, ints and floats come back as subclasses that also hold the text they were written
    as (read it with `spelling`); the config loader and sweep lists use it, everyone else wants plain values.
    """
    return yaml.load(text, Loader=_SpellingLoader if keep_spelling else Loader)


def spelling(value: Any) -> str | None:
    """The text a number read by `load_yaml(..., keep_spelling=True)` was written as; else None."""
    return getattr(value, "spelling", None) if isinstance(value, (_SpelledInt, _SpelledFloat)) else None


def dump_yaml(data: Any) -> str:
    """YAML text that `load_yaml` reads back to `data` (block style, keys in the given order)."""
    return yaml.dump(data, Dumper=Dumper, sort_keys=False)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML parse error on one line: "at line 2, column 9: expected ',' or ']', but got '<stream end>'"."""
    where = getattr(err, "problem_mark", None)
    place = f"at line {where.line + 1}, column {where.column + 1}: " if where else ""
    return place + (getattr(err, "problem", None) or str(err).splitlines()[0])


def _read_yaml_file(path: Path) -> Any:
    try:
        return load_yaml(path.read_text(), keep_spelling=True)
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; pass a YAML config file to --config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML {yaml_problem(err)}; fix the file") from None


# The presets shipped beside the package (the repository's configs/), which a bare --config name names.
SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def resolve_config(path: str | Path) -> Path:
    """The YAML file `path` names: an existing path as it is; else a bare name (`ernie.yaml`, `ernie`) of
    a shipped config in configs/, from any working directory; else a ConfigError listing the shipped ones."""
    given = Path(path)
    if given.is_file():
        return given
    if given.parent == Path("."):
        for name in (given.name, f"{given.name}.yaml"):
            if (SHIPPED_CONFIGS / name).is_file():
                return SHIPPED_CONFIGS / name
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise ConfigError(
        f"config file {path} does not exist; pass an existing YAML file to --config or a shipped config "
        f"by name ({shipped})"
    )


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML config (or start from defaults), apply `key.path=value` overrides, validate once."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config(path)
        loaded = _read_yaml_file(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        raw = loaded or {}
    for item in overrides:
        key, value = _parse_override(item, keep_spelling=True)
        set_path(raw, key, value)
    job = from_dict(JobConfig, raw)
    validate(job)
    return job


def with_overrides(job: JobConfig, overrides: dict[str, Any]) -> JobConfig:
    """A copy of `job` with `{"key.path": value}` overrides applied, validated like a loaded config."""
    raw = to_dict(job)
    for key, value in overrides.items():
        set_path(raw, key, value)
    updated = from_dict(JobConfig, raw)
    validate(updated)
    return updated


def parse_override(item: str) -> tuple[str, Any]:
    """`train.steps=20` -> ("train.steps", 20); the value is read as YAML (numbers, bools, lists, null)."""
    return _parse_override(item, keep_spelling=False)


def _parse_override(item: str, keep_spelling: bool) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value (e.g. train.steps=20)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = load_yaml(text, keep_spelling=keep_spelling) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML (e.g. `a: b: c`): the text itself, which only a string field accepts
    return key, value


def set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in a nested dict, creating sections on the way."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


MOVED = {"parallel.timeout_s": "train.hang_timeout_s"}  # old key -> the field that replaced it


def from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys (with a suggestion) and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        if f"{prefix}{key}" in MOVED:
            raise ConfigError(f"{prefix}{key} was replaced by {MOVED[f'{prefix}{key}']}; set that instead")
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"unknown config key {prefix}{key}{hint}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


# An int field takes a float only when it is a whole number the float holds exactly: `train.steps=1e4`
# means 10000 (Megatron users write it so), but 2.5 layers is a mistake. Above 2**53 a float written in
# the text (1.0000000000000001e16) may already have been rounded, so larger ones are refused.
_EXACT_INT_LIMIT = 2**53


def coerce(hint: Any, value: Any, name: str) -> Any:
    """Check `value` against a type hint and return it as a plain value of that type.

    Conversions, all lossless: a whole float to an int field (see _EXACT_INT_LIMIT); an int to a float
    field; a string that reads as a number (`"1e-3"`, quoted in YAML or produced by a template) to a
    number field, as it would read unquoted; a number to a string field as it was written (`1e-3`, `007`),
    where the loader kept that text. Float fields refuse nan and infinities: no field has a use for them
    (a learning rate, an epsilon, a timeout, a loss scale), and validation's range checks let inf through.
    """
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, f"{name}.")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return coerce(option, value, name)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{name} must be one of {choices}; got {_shown(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list (e.g. {name}=[1,2]); got {_shown(value)}")
        return [coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false; got {_shown(value)}")
        return value
    if hint is int:
        return _as_int(_number(value, name, "an integer"), name)
    if hint is float:
        return _as_float(_number(value, name, "a number"), name)
    if hint is str:
        if isinstance(value, str):
            return value
        if spelling(value) is not None:
            return spelling(value)
        raise ConfigError(f"{name} must be a string; got {_shown(value)} (quote it)")
    raise ConfigError(f"{name}: unsupported field type {hint!r}")


def _shown(value: Any) -> str:
    """A value in an error message as the user wrote it where known (`1e-3`, not 0.001)."""
    return spelling(value) or repr(value)


def _number(value: Any, name: str, kind: str) -> int | float:
    """`value` as an int or float, reading a string as YAML would read it unquoted."""
    if isinstance(value, str):
        try:
            parsed = load_yaml(value, keep_spelling=True)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
            return parsed
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be {kind}; got {_shown(value)}")


def _as_int(value: int | float, name: str) -> int:
    if isinstance(value, int):
        return int(value)
    if value.is_integer() and abs(value) <= _EXACT_INT_LIMIT:
        return int(value)
    reason = "a whole number" if not value.is_integer() else f"a whole number of at most 2**53 ({2**53})"
    raise ConfigError(f"{name} must be an integer; got {_shown(value)}, which is not {reason}")


def _as_float(value: int | float, name: str) -> float:
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise ConfigError(f"{name} must be a finite number; got {_shown(value)}")
    return result


def to_dict(job: JobConfig) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML dumps, checkpoints and metrics)."""
    return dataclasses.asdict(job)


def dump(job: JobConfig, path: str | Path) -> None:
    """Write the config as YAML that `load` reads back to an equal JobConfig."""
    Path(path).write_text(dump_yaml(to_dict(job)))
