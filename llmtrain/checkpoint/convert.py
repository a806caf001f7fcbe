"""Offline work on checkpoints (one process): read full tensors, describe a checkpoint.

Every function here takes a step directory, a `checkpoints/` directory or an output_dir (via `latest`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint.layout import GlobalTensor, Piece
from llmtrain.checkpoint.manager import read_meta, resolve, verify
from llmtrain.checkpoint.storage import read_metadata, read_tensors


def read_full(path: str | Path, prefix: str = "", names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors whose key starts with `prefix` (returned without it), optionally only `names`.

    Reads only what is asked: `prefix="model."` never touches the optimizer state.
    """
    path = resolve(Path(path))
    verify(path)
    metadata = read_metadata(path)
    wanted = {
        key: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and (names is None or key[len(prefix) :] in names)
    }
    out = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in wanted.items()}
    entries = {key: GlobalTensor(tuple(t.shape), [Piece(t, (0,) * t.dim())]) for key, t in out.items()}
    read_tensors(path, entries, None)
    return {key[len(prefix) :]: t for key, t in out.items()}


def info(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: step, layout that wrote it, model config, and every tensor's shape/dtype."""
    path = resolve(Path(path))
    meta = read_meta(path)
    metadata = read_metadata(path)
    tensors = {
        key: {
            "shape": list(md.size),
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "chunks": len(md.chunks),
            "bytes": math.prod(md.size) * md.properties.dtype.itemsize,
        }
        for key, md in sorted(metadata.state_dict_metadata.items())
        if isinstance(md, TensorStorageMetadata)
    }
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {
        "path": str(path),
        "step": meta["step"],
        "world_size": meta["world_size"],
        "layout": meta["layout"],
        "model": meta["model"],
        "tensors": tensors,
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
    }


def describe(path: str | Path) -> str:
    """`info` as text: a header and one line per tensor (what `convert_checkpoint.py inspect` prints)."""
    d = info(path)
    layout = " ".join(f"{k}={v}" for k, v in d["layout"].items())
    m = d["model"]
    model_bytes = sum(t["bytes"] for k, t in d["tensors"].items() if k.startswith("model."))
    lines = [
        f"{d['path']}: step {d['step']}, written by {d['world_size']} ranks ({layout})",
        f"model: {m['arch']} layers={m['num_layers']} hidden={m['hidden_size']} "
        f"heads={m['num_attention_heads']} vocab={m['vocab_size']}; {model_bytes / 2**20:.1f} MiB of weights",
        f"{len(d['tensors'])} tensors in {d['files']} files, {d['file_bytes'] / 2**20:.1f} MiB on disk",
    ]
    width = max(len(k) for k in d["tensors"]) if d["tensors"] else 0
    for key, t in d["tensors"].items():
        shape = "x".join(map(str, t["shape"])) or "scalar"
        lines.append(f"  {key:<{width}}  {t['dtype']:<8} {shape:<14} {t['chunks']} chunk(s)")
    return "\n".join(lines)
