"""Offline work on checkpoints, in one process: read full tensors, describe, re-chunk, convert to and from
Hugging Face.

Functions reading a checkpoint take a step directory, a `checkpoints/` directory or an output_dir (via
`latest`). Checkpoints are layout-independent (any layout loads any checkpoint); re-chunking for a target
(tp, pp, dp) only cuts each tensor into the rectangles that layout's ranks read, so each rank reads its own
bytes instead of whole tensors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import types
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.layout import GlobalTensor, ParamLayout, Piece
from llmtrain.checkpoint.manager import (
    LATEST,
    MANIFEST,
    TRAINER_STATE,
    Checkpointer,
    _Snapshot,
    read_meta,
    resolve,
    verify,
)
from llmtrain.checkpoint.state import MODEL, OPTIM, describe_model
from llmtrain.checkpoint.storage import read_metadata, read_tensors
from llmtrain.config import ConfigError, JobConfig, ModelConfig, ParallelConfig
from llmtrain.models import empty_model
from llmtrain.models.hf import (
    HF_CONFIG,
    HF_INDEX,
    WEIGHTS,
    hf_to_llmtrain_state,
    mapping,
    read_hf,
    to_hf_config,
)
from llmtrain.parallel.tensor_parallel import apply_tp, check_tp
from llmtrain.pipeline.stages import partition_layers


def read_full(path: str | Path, prefix: str = "", names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors whose key starts with `prefix` (returned without it), optionally only `names`.

    Reads only what is asked: `prefix="model."` never touches the optimizer state.
    """
    path = resolve(Path(path))
    verify(path)
    metadata = read_metadata(path)
    keys = [
        key
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and (names is None or key[len(prefix) :] in names)
    ]
    return {key[len(prefix) :]: t for key, t in _read(path, metadata, keys).items()}


def _read(path: Path, metadata: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors `keys` of a verified checkpoint."""
    saved = metadata.state_dict_metadata
    missing = [k for k in keys if k not in saved]
    if missing:
        raise CheckpointError(f"{path} has no tensor {missing[0]}")
    out = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in keys}
    read_tensors(
        path, {k: GlobalTensor(tuple(t.shape), [Piece(t, (0,) * t.dim())]) for k, t in out.items()}, None
    )
    return out


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


def tp_layouts(cfg: ModelConfig, tp: int) -> dict[str, list[ParamLayout]]:
    """Every parameter's layout on each of `tp` tensor-parallel ranks, from llmtrain.parallel's own sharding
    applied to a meta-device model (no memory, no processes)."""
    check_tp(cfg, tp, False)
    out: dict[str, list[ParamLayout]] = {}
    for rank in range(tp):
        model = empty_model(cfg, device="meta")
        # Without a TP group apply_tp only slices: a stand-in for the Topology is enough to get its layout.
        topo = types.SimpleNamespace(tp=tp, tp_rank=rank, pp=1, pp_rank=0, dp_rank=0, tp_group=None)
        apply_tp(model, topo)
        for name, m in describe_model(model, topo, cfg.tied_embeddings).items():
            out.setdefault(name, []).append(m.layout)
    return out


def chunked(name: str, full: torch.Tensor, layouts: list[ParamLayout] | None) -> GlobalTensor:
    """`full` cut into the rectangles its writers hold under `layouts` (one piece if None or a scalar)."""
    if layouts is None or full.dim() == 0:
        return GlobalTensor(tuple(full.shape), [Piece(full, (0,) * full.dim())])
    pieces = []
    for layout in layouts:
        if layout.global_shape != tuple(full.shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(full.shape)}, the model expects {layout.global_shape}"
            )
        if layout.writer:
            for b in layout.blocks:
                region = tuple(slice(o, o + n) for o, n in zip(b.global_offsets, b.sizes, strict=True))
                pieces.append(Piece(full[region], b.global_offsets))
    return GlobalTensor(tuple(full.shape), pieces)


def _check_layout(cfg: ModelConfig, tp: int, pp: int, dp: int) -> None:
    for label, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if value < 1:
            raise CheckpointError(f"--{label} must be at least 1; got {value}")
    try:
        partition_layers(cfg.num_layers, pp)  # raises when some stage would get no layer
        check_tp(cfg, tp, False)
    except ConfigError as err:
        raise CheckpointError(f"cannot lay this checkpoint out for tp={tp} pp={pp}: {err}") from None


def write_checkpoint(
    output_dir: str | Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    step: int,
    extra: dict[str, Any],
    scalars: dict[str, Any],
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
) -> Path:
    """Write full tensors (`model.<name>`, `optim.<name>.<state>`) as `<output_dir>/checkpoints/step_<step>`,
    chunked for the (tp, pp, dp) layout; returns the step directory."""
    _check_layout(cfg, tp, pp, dp)
    layouts = tp_layouts(cfg, tp)
    entries = {}
    for key, full in tensors.items():
        name = key[len(MODEL) :] if key.startswith(MODEL) else key[len(OPTIM) :].rsplit(".", 1)[0]
        if name not in layouts:
            raise CheckpointError(f"tensor {key} does not belong to a {cfg.arch} model of this config")
        entries[key] = chunked(key, full, layouts[name])
    missing = sorted(set(layouts) - {k[len(MODEL) :] for k in tensors if k.startswith(MODEL)})
    if missing:
        raise CheckpointError(
            f"no weights for {missing[0]} (and {len(missing) - 1} more) of this {cfg.arch} model"
        )
    job = JobConfig(model=cfg, parallel=ParallelConfig(tp=tp, pp=pp, dp=dp), output_dir=str(output_dir))
    topo = types.SimpleNamespace(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp)
    Checkpointer(job, topo)._commit(_Snapshot(step, entries, extra, None, scalars))
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A sharded checkpoint (step_<N>, checkpoints/ or an output_dir) rather than a model directory."""
    path = Path(path)
    return any((path / p).exists() for p in (MANIFEST, LATEST, Path("checkpoints") / LATEST))


def from_hf(hf_dir: str | Path, output_dir: str | Path, tp: int = 1, pp: int = 1, dp: int = 1) -> Path:
    """Hugging Face model directory -> llmtrain checkpoint at step 0, chunked for (tp, pp, dp).

    The run that loads it (checkpoint.load=<output_dir>) starts at step 0 with a fresh optimizer.
    """
    cfg, hf_state = read_hf(hf_dir)
    state = hf_to_llmtrain_state(cfg, hf_state, source=str(hf_dir))
    del hf_state
    tensors = {MODEL + k: v for k, v in state.items()}
    return write_checkpoint(output_dir, cfg, tensors, 0, {"step": 0, "consumed_samples": 0}, {}, tp, pp, dp)


def reshard(src: str | Path, output_dir: str | Path, tp: int = 1, pp: int = 1, dp: int = 1) -> Path:
    """Copy a checkpoint (model, optimizer, trainer state) chunked for the (tp, pp, dp) layout.

    Not needed for correctness (every layout loads every checkpoint); it makes each rank of the target
    layout read only its own bytes. Holds the full checkpoint in memory.
    """
    path = resolve(Path(src))
    meta = read_meta(path)
    cfg = ModelConfig(**meta["model"])
    tensors = read_full(path)
    trainer = torch.load(path / TRAINER_STATE, weights_only=True)
    return write_checkpoint(
        output_dir, cfg, tensors, meta["step"], trainer["extra"], trainer["optimizer"], tp, pp, dp
    )


def to_hf(src: str | Path, hf_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """llmtrain checkpoint (any layout) -> Hugging Face directory, tensors converted one mapping rule at a
    time (the optimizer state is never read), split into safetensors files of at most `max_shard_bytes`
    with a `model.safetensors.index.json` when there is more than one."""
    path = resolve(Path(src))
    cfg = ModelConfig(**read_meta(path)["model"])
    verify(path)
    metadata = read_metadata(path)
    out = Path(hf_dir)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    part: dict[str, torch.Tensor] = {}
    files: list[tuple[Path, list[str]]] = []
    size = total = 0
    dtype = None

    def flush() -> None:
        nonlocal part, size
        if part:
            file = tmp / f"part-{len(files) + 1}.safetensors"
            save_file(part, file, metadata={"format": "pt"})
            files.append((file, list(part)))
            part, size = {}, 0

    for rule in mapping(cfg):
        ours = _read(path, metadata, [MODEL + n for n in rule.ours])
        for hf_name, tensor in zip(rule.hf, rule.to_hf([ours[MODEL + n] for n in rule.ours]), strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > max_shard_bytes:
                flush()
            part[hf_name] = tensor.contiguous()
            dtype = dtype or tensor.dtype
            size += nbytes
            total += nbytes
    flush()
    (tmp / HF_CONFIG).write_text(json.dumps(to_hf_config(cfg, dtype or torch.float32), indent=2) + "\n")
    if len(files) == 1:
        files[0][0].rename(tmp / WEIGHTS)
    else:
        weight_map = {}
        for i, (file, names) in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            file.rename(tmp / name)
            weight_map.update(dict.fromkeys(names, name))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
