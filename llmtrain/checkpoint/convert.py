"""Offline work on checkpoints, in one process: read full tensors, describe, re-chunk, convert to and from
Hugging Face, load as one model.

Functions reading a checkpoint take a step directory, a `checkpoints/` directory or an output_dir (via
`latest`). Checkpoints are layout-independent (any layout loads any checkpoint); re-chunking for a target
(tp, pp, dp) only cuts each tensor into the rectangles that layout's ranks read, so each rank reads its own
bytes instead of whole tensors.

Tokenizers travel with the weights: a checkpoint keeps its run's tokenizer files in `tokenizer/`, a model
directory (Hugging Face or llmtrain) beside its weights; every conversion carries them over, and the
Hugging Face export writes them as Hugging Face tokenizer files (llmtrain.data.tokenizer_export). This room
imports llmtrain.data for that alone (data imports nothing of checkpoint, so no cycle).
"""

from __future__ import annotations

import math
import shlex
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint.directory import (
    EXPECTED,
    TOKENIZER_DIR,
    TRAINER_STATE,
    is_checkpoint,
    model_directory_kind,
    read_meta,
    resolve,
    saved_model_config,
    verify,
)
from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.manager import Checkpointer, _Snapshot
from llmtrain.checkpoint.state import MODEL, OPTIM
from llmtrain.checkpoint.storage import GlobalTensor, read_metadata, read_tensors
from llmtrain.config import ConfigError, JobConfig, ModelConfig, ParallelConfig
from llmtrain.data.tokenizer import HF_TOKENIZER_FILE, SENTENCEPIECE_FILE, Tokenizer, load_tokenizer
from llmtrain.data.tokenizer_export import export_hf_tokenizer
from llmtrain.models import CausalLM, empty_model
from llmtrain.models.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    LLMTRAIN_CONFIG,
    WEIGHTS,
    ModelFormatError,
    detect_format,
    llmtrain_to_hf_state,
    mapping,
    model_from_state,
    read_any,
    read_llmtrain,
    write_hf,
    write_llmtrain,
)
from llmtrain.parallel.param_layout import ParamLayout, Piece, describe_model
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


def load_model(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> CausalLM:
    """The model of a training checkpoint (any layout that wrote it) as one CausalLM in eval mode; dtype
    defaults to the stored one. Reads the model tensors only, never the optimizer state."""
    step = resolve(Path(path))
    cfg = saved_model_config(step, read_meta(step))
    return model_from_state(cfg, read_full(step, prefix=MODEL), device, dtype).eval()


def info(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: step, layout that wrote it, model config, every tensor's shape/dtype, and
    the tokenizer files it carries."""
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
        "tokenizer": sorted(p.name for p in (path / TOKENIZER_DIR).glob("*")),
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
        f"tokenizer: {', '.join(d['tokenizer']) if d['tokenizer'] else 'none'}",
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
        topo = types.SimpleNamespace(
            tp=tp, tp_rank=rank, pp=1, pp_rank=0, dp_rank=0, ep=1, tp_group=None, device=torch.device("cpu")
        )
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
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write full tensors (`model.<name>`, `optim.<name>.<state>`) as `<output_dir>/checkpoints/step_<step>`,
    chunked for the (tp, pp, dp) layout, with `tokenizer`'s files; returns the step directory."""
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
    Checkpointer(job, topo, tokenizer=tokenizer, alone=True)._commit(
        _Snapshot(step, entries, extra, None, scalars)
    )
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def tokenizer_source(path: Path) -> Path | None:
    """The directory holding the tokenizer of a checkpoint step (its tokenizer/) or of a model directory
    (beside the weights); None when it carries none."""
    for folder in (path / TOKENIZER_DIR, path):
        if (folder / HF_TOKENIZER_FILE).is_file() or (folder / SENTENCEPIECE_FILE).is_file():
            return folder
    return None


def _stored_tokenizer(path: Path) -> Tokenizer | None:
    source = tokenizer_source(path)
    return load_tokenizer(source) if source is not None else None


def _refuse_checkpoint(path: Path) -> None:
    if is_checkpoint(path):
        raise CheckpointError(
            f"{path} is a training checkpoint, not a model directory; export it with python "
            f"tools/convert_checkpoint.py llmtrain-to-hf --input {shlex.quote(str(path))} --output OUT_DIR, "
            "or re-lay it out with the reshard subcommand"
        )


def from_hf(model_dir: str | Path, output_dir: str | Path, tp: int = 1, pp: int = 1, dp: int = 1) -> Path:
    """Hugging Face (or llmtrain) model directory -> llmtrain checkpoint at step 0, chunked for (tp, pp, dp),
    carrying the directory's tokenizer.

    The run that loads it (checkpoint.load=<output_dir>) starts at step 0 with a fresh optimizer.
    """
    model_dir = Path(model_dir)
    _refuse_checkpoint(model_dir)
    cfg, state = read_any(model_dir)
    tensors = {MODEL + k: v for k, v in state.items()}
    del state
    extra = {"step": 0, "consumed_samples": 0}
    return write_checkpoint(output_dir, cfg, tensors, 0, extra, {}, tp, pp, dp, _stored_tokenizer(model_dir))


def import_model(
    src: str | Path, dst: str | Path, tp: int | None = None, pp: int | None = None, dp: int | None = None
) -> Path:
    """`convert_checkpoint.py hf-to-llmtrain`: a Hugging Face model directory -> an llmtrain model directory,
    or, given any of tp/pp/dp, a checkpoint chunked for that layout (from an llmtrain model directory too).
    The tokenizer comes along. Returns what was written."""
    src = Path(src)
    if tp is None and pp is None and dp is None:
        _refuse_checkpoint(src)
        if detect_format(src) != "hf":
            raise ModelFormatError(
                f"{src} is an llmtrain model directory, not a Hugging Face one; convert it with "
                "llmtrain-to-hf, or give --tp/--pp to write a training checkpoint from it"
            )
        cfg, state = read_any(src)
        tokenizer = _stored_tokenizer(src)
        write_llmtrain(cfg, state, dst, tokenizer.files() if tokenizer is not None else None)
        return Path(dst)
    return from_hf(src, dst, tp or 1, pp or 1, dp or 1)


def reshard(src: str | Path, output_dir: str | Path, tp: int = 1, pp: int = 1, dp: int = 1) -> Path:
    """Copy a checkpoint (model, optimizer, trainer state, tokenizer) chunked for the (tp, pp, dp) layout.

    Not needed for correctness (every layout loads every checkpoint); it makes each rank of the target
    layout read only its own bytes. Holds the full checkpoint in memory.
    """
    path = resolve(Path(src))
    meta = read_meta(path)
    cfg = saved_model_config(path, meta)
    tensors = read_full(path)
    trainer = torch.load(path / TRAINER_STATE, weights_only=True)
    return write_checkpoint(
        output_dir,
        cfg,
        tensors,
        meta["step"],
        trainer["extra"],
        trainer["optimizer"],
        tp,
        pp,
        dp,
        _stored_tokenizer(path),
    )


def to_hf(
    src: str | Path,
    hf_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | Path | None = None,
    include_tokenizer: bool = True,
) -> Path | None:
    """llmtrain checkpoint (any layout) or llmtrain model directory -> Hugging Face directory that
    transformers' AutoModelForCausalLM and AutoTokenizer load.

    Checkpoint tensors are converted one mapping rule at a time (the optimizer state is never read) and
    split into safetensors files of at most `max_shard_bytes`. The tokenizer is `tokenizer` (a SentencePiece
    model or Hugging Face tokenizer directory) if given, else the one `src` carries; its files and bos/eos/pad
    ids are written unless `include_tokenizer` is False. Returns the tokenizer exported, None if none was.
    """
    src = Path(src)
    if is_checkpoint(src) or not src.exists():
        path = resolve(src)
        cfg = saved_model_config(path, read_meta(path))
        verify(path)
        tensors: Any = _hf_tensors(path, read_metadata(path), cfg)
    else:
        if model_directory_kind(src) is None:
            raise CheckpointError(
                f"{src} is neither a training checkpoint nor an llmtrain model directory ({LLMTRAIN_CONFIG} "
                f"+ {WEIGHTS}); {EXPECTED}, or an llmtrain model directory"
            )
        if detect_format(src) != "llmtrain":
            raise ModelFormatError(
                f"{src} is a Hugging Face model directory already; to train from it, convert it with "
                "hf-to-llmtrain"
            )
        path = src
        cfg, state = read_llmtrain(src)
        tensors = llmtrain_to_hf_state(cfg, state, source=str(src))
    source = None
    if include_tokenizer:
        source = Path(tokenizer) if tokenizer is not None else tokenizer_source(path)
    if source is not None and not source.exists():
        raise ModelFormatError(
            f"tokenizer {source} does not exist; give --tokenizer a SentencePiece .model file or a Hugging "
            "Face tokenizer directory"
        )
    exported = export_hf_tokenizer(source, cfg.max_positions) if source is not None else None
    if exported is not None and exported.vocab_size > cfg.vocab_size:
        raise ModelFormatError(
            f"tokenizer {source} has {exported.vocab_size} tokens, more than the model's vocab_size="
            f"{cfg.vocab_size}: it is not this model's tokenizer; give the right one with --tokenizer"
        )
    write_hf(
        cfg,
        tensors,
        hf_dir,
        max_shard_bytes,
        exported.files if exported is not None else None,
        exported.token_ids() if exported is not None else None,
    )
    return source


def _hf_tensors(path: Path, metadata: Any, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of a verified checkpoint, read and converted one mapping rule at a time."""
    for rule in mapping(cfg):
        ours = _read(path, metadata, [MODEL + n for n in rule.ours])
        yield from zip(rule.hf, rule.to_hf([ours[MODEL + n] for n in rule.ours]), strict=True)
