"""YAML files and `key.path=value` overrides into a typed, validated JobConfig."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig
from llmtrain.config.validate import validate


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML config (or start from defaults), apply `key.path=value` overrides, validate once."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        raw = loaded or {}
    for item in overrides:
        key, value = parse_override(item)
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
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value (e.g. train.steps=20)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
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


def from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys (with a suggestion) and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"unknown config key {prefix}{key}{hint}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def coerce(hint: Any, value: Any, name: str) -> Any:
    """Check `value` against a type hint, converting only where it is lossless (int -> float)."""
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
            raise ConfigError(f"{name} must be one of {choices}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list (e.g. {name}=[1,2]); got {value!r}")
        return [coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false; got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer; got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number; got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string; got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported field type {hint!r}")


def to_dict(job: JobConfig) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML dumps, checkpoints and metrics)."""
    return dataclasses.asdict(job)


def dump(job: JobConfig, path: str | Path) -> None:
    """Write the config as YAML that `load` reads back to an equal JobConfig."""
    Path(path).write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
