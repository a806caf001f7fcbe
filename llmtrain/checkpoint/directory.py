"""A checkpoints directory on disk: its layout, which checkpoint to load, verifying one, and whether it fits.

Layout of `<output_dir>/checkpoints/`:
    step_<N>/            a complete checkpoint (has manifest.json, written last)
        .metadata, __<rank>_<i>.distcp   DCP index and each rank's tensor pieces
        rng/rank_<r>.pt  RNG states of rank r
        trainer_state.pt the trainer's `extra` (LR schedule, loss scaler, consumed samples, ...)
        tokenizer/       the run's tokenizer files (tokenizer.model, or a Hugging Face tokenizer's files)
        meta.json        step, model config, job config, layout that wrote it
        manifest.json    size and CRC-32 of every file above
    latest               name of the newest complete checkpoint (replaced atomically)
    .tmp_step_<N>/       a save in progress (or one that crashed): never loaded, removed by the next save
    .old_step_<N>/, .deleting_step_<N>/   a checkpoint being replaced or pruned: removed by the next save
Every rank writes into the same directory, so output_dir must be on a file system all ranks share.

`resolve` finds the complete checkpoint a path means, `last_good_checkpoint` the one a run resumes from,
`verify` checks files against the manifest, `read_meta` reads meta.json, and `check_model_config` /
`check_tensors` say, naming the field or tensor, why a checkpoint does not fit the model. Writing checkpoints
is llmtrain.checkpoint.manager's (Checkpointer).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmtrain.checkpoint.errors import CheckpointError
from llmtrain.checkpoint.state import MODEL
from llmtrain.checkpoint.storage import file_checksum
from llmtrain.config import ModelConfig
from llmtrain.models.hf import HF_CONFIG, LLMTRAIN_CONFIG

FORMAT = "llmtrain-dcp-1"
MANIFEST = "manifest.json"
META = "meta.json"
TRAINER_STATE = "trainer_state.pt"
TOKENIZER_DIR = "tokenizer"
LATEST = "latest"
STEP_DIR = re.compile(r"step_(\d+)")
PARTIAL_DIR = re.compile(r"\.tmp_step_(\d+)")

# (config field, resolved property) pairs that change the model's tensors: compared on load.
SHAPE_FIELDS = (
    ("arch", "arch"),
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_kv_heads", "kv_heads"),
    ("head_dim", "head_size"),
    ("ffn_hidden_size", "ffn_size"),
    ("vocab_size", "vocab_size"),
    ("tie_word_embeddings", "tied_embeddings"),
    ("use_bias", "bias"),
)
# Of a mixture of experts (the arch already equal): fields that change the expert tensors' shapes.
MOE_SHAPE_FIELDS = (
    ("num_experts", "num_experts"),
    ("moe_ffn_hidden_size", "expert_ffn_size"),
    ("num_shared_experts", "num_shared_experts"),
)


def step_of(path: Path) -> int | None:
    """N for a step_<N> directory, else None."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


EXPECTED = "give a step_<N> directory, a checkpoints/ directory or an output_dir that holds one"


def resolve(path: Path) -> Path:
    """A complete step directory from a step dir, a checkpoints dir or an output_dir (via `latest`).

    Anything else raises a CheckpointError naming what `path` is instead (nothing, an incomplete save, a
    Hugging Face or llmtrain model directory, which it says how to convert) and what to give.
    """
    for candidate in (path, path / "checkpoints"):
        pointer = candidate / LATEST
        if pointer.is_file():
            target = candidate / pointer.read_text().strip()
            if not (target / MANIFEST).is_file():
                raise CheckpointError(
                    f"{pointer} names {target.name}, which is not a complete checkpoint "
                    f"({MANIFEST} missing); point checkpoint.load at an earlier step_<N>"
                )
            return target
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; {EXPECTED}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; {EXPECTED}")
    kind = model_directory_kind(path)
    if kind is not None:
        out = path.with_name(f"{path.name}-checkpoint")
        raise CheckpointError(
            f"{path} is {kind}, not a training checkpoint; convert it first: python "
            f"tools/convert_checkpoint.py hf-to-llmtrain --input {shlex.quote(str(path))} --output "
            f"{shlex.quote(str(out))} --tp N --pp N (your training layout), then load {shlex.quote(str(out))}"
        )
    if (path / ".metadata").exists() or any(path.glob("*.distcp")):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint ({MANIFEST} missing: its save was interrupted); "
            "load an earlier step_<N>"
        )
    raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST} and no {LATEST} pointer); {EXPECTED}")


def model_directory_kind(path: Path) -> str | None:
    """'a Hugging Face model directory' or 'an llmtrain model directory' by the config file in `path`."""
    if (path / HF_CONFIG).is_file():
        return "a Hugging Face model directory"
    if (path / LLMTRAIN_CONFIG).is_file():
        return "an llmtrain model directory"
    return None


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is meant as a training checkpoint (complete or not) rather than a model directory:
    a step directory, a checkpoints/ directory or an output_dir with one."""
    path = Path(path)
    return (path / "checkpoints").is_dir() or any(
        (path / p).exists() for p in (MANIFEST, LATEST, ".metadata")
    )


def verify(
    path: Path, rank: int = 0, world_size: int = 1, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Check every file in the manifest exists with its size and CRC-32 (the ranks split the reading)."""
    manifest, problem = _read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{problem}; copy the checkpoint again or load an earlier step_<N>")
    problems = _file_problems(path, manifest["files"], rank, world_size)
    if group is not None:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} failed verification: {'; '.join(problems)}; copy the checkpoint again from "
            "its source or load an earlier step_<N>"
        )
    return manifest


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The manifest of checkpoint `path`, or None and why it cannot be read."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not isinstance(manifest["files"], dict):
            raise ValueError("its 'files' is not a mapping")
    except FileNotFoundError:
        return None, f"{path / MANIFEST} is missing: the save of this checkpoint never finished"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{path / MANIFEST} is unreadable or corrupt ({err})"
    return manifest, ""


def _file_problems(path: Path, files: dict[str, Any], rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with this rank's share of the files the manifest lists (missing, size, CRC-32)."""
    problems = []
    for name in sorted(files)[rank::world_size]:
        f, want = path / name, files[name]
        if not f.is_file():
            problems.append(f"{f} is missing (a shard of this checkpoint was deleted or never copied)")
        elif f.stat().st_size != want["bytes"]:
            problems.append(
                f"{f} is truncated or overwritten: {f.stat().st_size} bytes, expected {want['bytes']}"
            )
        elif (crc := file_checksum(f)) != want["crc32"]:
            problems.append(f"{f} is corrupt: CRC-32 {crc}, manifest says {want['crc32']}")
    return problems


def last_good_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint a run resumes from in its checkpoints directory `root` (None when there is none), and
    one line for each newer save it skipped, saying why (naming the file at fault).

    That is the checkpoint `latest` names (a save counts once `latest` names it), or, when that one is
    missing or fails verification, the newest earlier one that passes. Reads every file of each checkpoint
    it checks; raises a CheckpointError when `root` holds checkpoints `latest` covers but none passes,
    rather than let the run start again from step 0.
    """
    if not root.is_dir():
        return None, []
    steps = sorted((s for p in root.iterdir() if (s := step_of(p)) is not None), reverse=True)
    named = _latest_step(root)
    skipped = [
        (int(m.group(1)), f"{p.name} (a save interrupted before it was published)")
        for p in root.iterdir()
        if (m := PARTIAL_DIR.fullmatch(p.name))
    ]
    for step in steps:
        if named is None or step > named:
            recorded = f"{LATEST} names step_{named}" if named is not None else f"there is no {LATEST}"
            skipped.append((step, f"step_{step} ({recorded}: this save did not complete)"))
    if named is not None and named not in steps:
        skipped.append((named, f"step_{named} ({LATEST} names it, but it is missing)"))
    damaged: list[tuple[int, str]] = []
    for step in (s for s in steps if named is not None and s <= named):
        path = root / f"step_{step}"
        manifest, problem = _read_manifest(path)
        problems = [problem] if manifest is None else _file_problems(path, manifest["files"])
        if not problems:
            newer = sorted(damaged + [(s, text) for s, text in skipped if s >= step], reverse=True)
            return path, [text for _, text in newer]
        damaged.append((step, f"{path.name} ({'; '.join(problems)})"))
    if damaged:
        raise CheckpointError(
            f"no checkpoint in {root} passes verification: {'; '.join(text for _, text in damaged)}; copy "
            "the checkpoints again from their source, or move them away to start the run afresh"
        )
    return None, [text for _, text in sorted(skipped, reverse=True)]


def _latest_step(root: Path) -> int | None:
    """The step of the checkpoint `latest` in `root` names; None without a `latest`."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    match = STEP_DIR.fullmatch(text)
    if match is None:
        raise CheckpointError(
            f"{pointer} holds {text!r}, not the name of a step_<N> directory; write the name of the "
            "checkpoint to resume from into it"
        )
    return int(match.group(1))


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json (format, step, model and job config, layout)."""
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
            raise ValueError("no model section")
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / META} is missing or corrupt ({err}); copy the checkpoint again or load an earlier "
            "step_<N>"
        ) from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / META}: format {meta.get('format')!r} is not {FORMAT!r}; this checkpoint was written by "
            "another tool or version: load it with the version that wrote it"
        )
    return meta


def saved_model_config(path: Path, meta: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a checkpoint's meta.json records."""
    try:
        return ModelConfig(**meta["model"])
    except TypeError as err:
        raise CheckpointError(
            f"{path / META} records a model config this version does not know ({err}); load it with the "
            "llmtrain version that wrote it"
        ) from None


def check_model_config(path: Path, meta: dict[str, Any], model: ModelConfig) -> None:
    """Raise naming the first model field whose saved value gives other tensors than this job's."""
    saved = saved_model_config(path, meta)
    # Dense archs ignore the MoE fields, whatever their values.
    fields = SHAPE_FIELDS + (MOE_SHAPE_FIELDS if saved.is_moe and saved.arch == model.arch else ())
    for field, prop in fields:
        a, b = getattr(saved, prop), getattr(model, prop)
        if a != b:
            raise CheckpointError(
                f"{path} holds a model with model.{field}={a}, this job has model.{field}={b}; "
                f"set model.{field}={a} or load a checkpoint of this model"
            )
    if saved.is_moe and saved.arch == model.arch:
        moe_layers = [i for i in range(saved.num_layers) if saved.is_moe_layer(i)]
        ours = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
        if moe_layers != ours:
            raise CheckpointError(
                f"{path} holds experts in layers {moe_layers}, this job in layers {ours}; set "
                f"model.moe_layer_start={saved.moe_layer_start}, model.moe_layer_interval="
                f"{saved.moe_layer_interval} and model.dense_layers={saved.dense_layers} as the checkpoint's "
                "model has them"
            )
    if model.arch == "gpt" and saved.max_positions != model.max_positions:
        raise CheckpointError(
            f"{path} holds a position table of {saved.max_positions} rows, this job has "
            f"{model.max_positions}; set model.max_position_embeddings={saved.max_positions}"
        )


def check_tensors(
    path: Path, metadata: Any, expected: dict[str, tuple[int, ...]], whole: bool = True
) -> None:
    """Raise naming the first model tensor that is missing, of another shape, or (`whole` model) extra."""
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    for key, shape in expected.items():
        if key not in saved:
            raise CheckpointError(
                f"{path} has no tensor {key[len(MODEL) :]}; it was saved from another model"
            )
        if saved[key] != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {key[len(MODEL) :]} has shape {saved[key]} in the checkpoint, "
                f"{tuple(shape)} in this model"
            )
    for key in sorted(saved.keys() - expected.keys()) if whole else ():
        raise CheckpointError(
            f"{path} holds tensor {key[len(MODEL) :]} that this model does not have; "
            "it was saved from another model"
        )
