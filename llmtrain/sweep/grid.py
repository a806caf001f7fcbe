"""The settings of a sweep: a grid of `key=v1,v2` axes or an explicit YAML list, each point named."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmtrain.config.loader import load_yaml, spelling, yaml_problem
from llmtrain.sweep.errors import SweepError


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: its directory name and its `key.path=value` overrides (values as text)."""

    name: str
    overrides: dict[str, str]

    @property
    def args(self) -> list[str]:
        """The overrides as command-line arguments."""
        return [f"{key}={value}" for key, value in self.overrides.items()]


def _split_values(text: str) -> list[str]:
    """Split `1,2,[3,4]` on the commas outside brackets: list values such as [10,12] stay whole."""
    values, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += char
    values.append(current)
    return [v.strip() for v in values]


def parse_grid(grid: str) -> list[SweepPoint]:
    """`"parallel.tp=1,2 train.micro_batch_size=1,2,4"` -> the 6 points of the product, first axis slowest."""
    axes: dict[str, list[str]] = {}
    for item in grid.split():
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise SweepError(f"--grid item {item!r} is not of the form key.path=v1,v2 (e.g. parallel.tp=1,2)")
        if key in axes:
            raise SweepError(f"--grid names {key} twice; give all its values in one item ({key}=a,b)")
        values = _split_values(text)
        if "" in values:
            raise SweepError(f"--grid item {item!r} has an empty value; separate values by single commas")
        axes[key] = values
    if not axes:
        raise SweepError("--grid is empty; give at least one key.path=v1,v2 axis")
    combos = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return name_points(combos)


def _as_text(value: Any) -> str:
    """A YAML value as the override text tools/pretrain.py reads back to the same value.

    A number goes as it was written (`1e-3` stays `1e-3`, so a string field such as a run name gets the text
    the user wrote); inside a list, strings are quoted so they stay strings.
    """
    if isinstance(value, str):
        return value
    return _as_flow_text(value)


def _as_flow_text(value: Any) -> str:
    if spelling(value) is not None:
        return spelling(value)
    if isinstance(value, list):
        return "[" + ", ".join(_as_flow_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_as_flow_text(k)}: {_as_flow_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # true/false/null, quoted strings: valid YAML too


def load_list(path: str | Path) -> list[SweepPoint]:
    """Points from a YAML list of mappings `{key.path: value, ...}`; an optional `name` key names the run."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"--list file {path} does not exist; pass a YAML list of override mappings")
    try:
        items = load_yaml(path.read_text(), keep_spelling=True)
    except yaml.YAMLError as err:
        raise SweepError(f"--list file {path} is not valid YAML {yaml_problem(err)}") from None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise SweepError(f"{path}: expected a non-empty YAML list of mappings like '- {{parallel.tp: 2}}'")
    names = [str(item["name"]) if "name" in item else None for item in items]
    combos = [{str(k): _as_text(v) for k, v in item.items() if k != "name"} for item in items]
    points = name_points(combos)
    return [
        SweepPoint(_safe(name), point.overrides) if name else point
        for name, point in zip(names, points, strict=True)
    ]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def name_points(combos: list[dict[str, str]]) -> list[SweepPoint]:
    """Readable, unique directory names: `tp-2_micro_batch_size-4` (full keys where last parts clash)."""
    keys = list(dict.fromkeys(k for combo in combos for k in combo))
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    clashing = {s for s in short.values() if list(short.values()).count(s) > 1}
    label = {k: (k.replace(".", "-") if short[k] in clashing else short[k]) for k in keys}
    points, seen = [], set()
    for combo in combos:
        name = _safe("_".join(f"{label[k]}-{v}" for k, v in combo.items())) if combo else "base"
        if len(name) > 96:  # keep paths usable; the hash keeps long names distinct
            name = name[:80] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
        unique, n = name, 2
        while unique in seen:
            unique, n = f"{name}-{n}", n + 1
        seen.add(unique)
        points.append(SweepPoint(unique, combo))
    return points
