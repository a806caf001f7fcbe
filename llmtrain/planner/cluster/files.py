"""Cluster files: the YAML structure of a cluster (llmtrain/planner/clusters/*.yaml, or what
tools/calibrate.py writes), read and checked into a Cluster and written back; the shipped presets by name.
"""

from __future__ import annotations

from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from llmtrain.config.errors import ConfigError
from llmtrain.config.loader import load_yaml
from llmtrain.planner.cluster.hardware import MEMORY_KINDS, Cluster, Device, Link, NodeGroup, link_names

PRESETS = resources.files("llmtrain.planner") / "clusters"
"""The shipped cluster files (package data): `--cluster NAME` reads PRESETS / NAME.yaml."""


def _build(cls: type, raw: Any, where: str, **extra: Any) -> Any:
    """A frozen dataclass from a mapping, naming unknown and missing keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping; got {raw!r}")
    names = {f.name for f in fields(cls)} - set(extra)
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(names))}")
    try:
        return cls(**raw, **extra)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


MEASURED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
"""The collectives a link's `measured` table may hold (what tools/calibrate.py times)."""


def _check_points(points: Any, where: str, pair: str) -> None:
    """A measured table: a non-empty list of pairs of positive numbers."""
    if not isinstance(points, list) or not points:
        raise ConfigError(f"{where} must be a non-empty list of {pair} pairs")
    for point in points:
        if not isinstance(point, list) or len(point) != 2:
            raise ConfigError(f"{where}: each entry must be a {pair} pair; got {point!r}")
        for value in point:
            _positive(value, where)


def _positive(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where} must be a positive number; got {value!r}")


def cluster_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Cluster:
    """Build and check a Cluster from the YAML structure (see llmtrain/planner/clusters/*.yaml)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a cluster file must be a mapping with devices, nodes and links")
    for key in ("devices", "nodes", "links"):
        if key not in raw:
            raise ConfigError(f"{source}: missing top-level key {key!r} (see {PRESETS / 'a100-80gb.yaml'})")
    top = {"name", "devices", "nodes", "links", "cross_node_tp", "description", "sources", "calibration"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key {unknown[0]!r}")
    devices = {}
    for name, spec in (raw["devices"] or {}).items():
        dev = _build(Device, spec, f"{source}: devices.{name}", name=str(name))
        for precision, tflops in dev.peak_tflops.items():
            _positive(tflops, f"{source}: devices.{name}.peak_tflops.{precision}")
        for attr in (
            "memory_gb",
            "memory_bandwidth_gbs",
            "gemm_efficiency",
            "memory_efficiency",
            "attention_efficiency",
        ):
            _positive(getattr(dev, attr), f"{source}: devices.{name}.{attr}")
        if not isinstance(dev.gemm_table, dict):
            raise ConfigError(f"{source}: devices.{name}.gemm_table must map precisions to measured points")
        for precision, points in dev.gemm_table.items():
            _check_points(points, f"{source}: devices.{name}.gemm_table.{precision}", "[FLOPs, TFLOP/s]")
        if not isinstance(dev.memory_table, dict) or set(dev.memory_table) - set(MEMORY_KINDS):
            raise ConfigError(
                f"{source}: devices.{name}.memory_table must map operator kinds ({', '.join(MEMORY_KINDS)}) "
                "to measured points"
            )
        for kind, points in dev.memory_table.items():
            _check_points(points, f"{source}: devices.{name}.memory_table.{kind}", "[bytes, GB/s]")
        devices[str(name)] = dev
    links = raw["links"] or {}
    if "inter_node" not in links:
        raise ConfigError(f"{source}: links.inter_node is missing (bandwidth_gbs per device, latency_us)")
    parsed_links = {}
    for name, spec in links.items():
        link = _build(Link, spec, f"{source}: links.{name}")
        _positive(link.bandwidth_gbs, f"{source}: links.{name}.bandwidth_gbs")
        if not isinstance(link.measured, dict):
            raise ConfigError(f"{source}: links.{name}.measured must map operations to group sizes")
        for op, groups in link.measured.items():
            where = f"{source}: links.{name}.measured.{op}"
            if op not in MEASURED_OPS or not isinstance(groups, dict):
                raise ConfigError(
                    f"{where}: measured operations are {', '.join(MEASURED_OPS)}, each a mapping"
                )
            for size, points in groups.items():
                if isinstance(size, bool) or not isinstance(size, int) or size < 2:
                    raise ConfigError(f"{where}: group sizes must be integers >= 2; got {size!r}")
                _check_points(points, f"{where}.{size}", "[bytes, seconds]")
        parsed_links[name] = link
    groups = []
    for i, spec in enumerate(raw["nodes"] or []):
        where = f"{source}: nodes[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where} must be a mapping with count, devices_per_node, device, intra_link")
        unknown = sorted(set(spec) - {"count", "devices_per_node", "device", "intra_link"})
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
        if spec.get("device") not in devices:
            raise ConfigError(
                f"{where}.device={spec.get('device')!r} is not one of devices: {', '.join(devices)}"
            )
        link_name = spec.get("intra_link", "intra_node")
        if link_name not in parsed_links:
            raise ConfigError(
                f"{where}.intra_link={link_name!r} is not one of links: {', '.join(parsed_links)}"
            )
        for key in ("count", "devices_per_node"):
            if not isinstance(spec.get(key), int) or spec[key] < 1:
                raise ConfigError(f"{where}.{key} must be a positive integer; got {spec.get(key)!r}")
        groups.append(
            NodeGroup(
                spec["count"], spec["devices_per_node"], devices[spec["device"]], parsed_links[link_name]
            )
        )
    if not groups:
        raise ConfigError(f"{source}: nodes is empty; list at least one node group")
    cluster = Cluster(
        name=str(raw.get("name", Path(source).stem)),
        nodes=tuple(groups),
        inter=parsed_links["inter_node"],
        cross_node_tp=bool(raw.get("cross_node_tp", False)),
        source=source,
        sources=_sources(raw.get("sources") or {}, source),
        intra_names=tuple(spec.get("intra_link", "intra_node") for spec in raw["nodes"]),
    )
    known = set(cluster.constants())
    for key in cluster.sources:
        if key not in known:
            raise ConfigError(
                f"{source}: sources.{key} names no constant of this cluster; use DEVICES or LINKS paths such "
                f"as {sorted(known)[0]}"
            )
    return cluster


def _sources(raw: Any, source: str) -> dict[str, str]:
    """The `sources` mapping, checked: dotted constant names to non-empty citation strings."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: sources must map constant names (devices.NAME.FIELD) to citations")
    for key, text in raw.items():
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{source}: sources.{key} must be a citation string; got {text!r}")
    return {str(k): v for k, v in raw.items()}


def preset_names() -> list[str]:
    """Names of the shipped cluster presets (a100-80gb, h100-80gb, ...)."""
    return sorted(
        entry.name.removesuffix(".yaml") for entry in PRESETS.iterdir() if entry.name.endswith(".yaml")
    )


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster YAML file, or a shipped preset by name (a100-80gb, h100-80gb)."""
    source = Path(path)
    if not source.is_file():
        source = PRESETS / f"{path}.yaml"
        if not source.is_file():
            presets = ", ".join(preset_names())
            raise ConfigError(f"cluster file {path} does not exist; pass a YAML path or a preset ({presets})")
    try:
        raw = load_yaml(source.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise ConfigError(
            f"cluster file {source} is not valid YAML{where}: {problem}; fix the file"
        ) from None
    return cluster_from_dict(raw, str(source))


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The YAML structure of a cluster (inverse of cluster_from_dict)."""
    devices, links, nodes = {}, {"inter_node": vars_of(cluster.inter)}, []
    for g, link_name in zip(cluster.nodes, link_names(cluster), strict=False):
        devices[g.device.name] = {k: v for k, v in vars_of(g.device).items() if k != "name"}
        links[link_name] = vars_of(g.intra)
        nodes.append(
            {
                "count": g.count,
                "devices_per_node": g.devices_per_node,
                "device": g.device.name,
                "intra_link": link_name,
            }
        )
    return {
        "name": cluster.name,
        "cross_node_tp": cluster.cross_node_tp,
        "devices": devices,
        "nodes": nodes,
        "links": links,
        "sources": dict(cluster.sources),
    }


def vars_of(obj: Any) -> dict[str, Any]:
    """Dataclass fields as a plain dict (dict values copied)."""
    return {f.name: (dict(v) if isinstance(v := getattr(obj, f.name), dict) else v) for f in fields(obj)}
