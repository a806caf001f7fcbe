"""Model directories on disk: reading and writing llmtrain ones (`llmtrain_config.yaml` + `model.safetensors`
with llmtrain parameter names, a tied lm_head not stored) and Hugging Face ones (`config.json` +
`model.safetensors` or a sharded `model.safetensors.index.json`, as transformers' save_pretrained lays them
out: experts one tensor per expert and projection), atomically, with the tokenizer's files beside them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmtrain.config import ConfigError, ModelConfig
from llmtrain.config.loader import dump_yaml, from_dict, load_yaml
from llmtrain.models.causal_lm import CausalLM, check_config
from llmtrain.models.hf.adapter import ModelFormatError, Tensors
from llmtrain.models.hf.conversion import (
    from_hf_config,
    hf_to_llmtrain_state,
    llmtrain_to_hf_state,
    model_from_state,
    model_state,
    to_hf_config,
)
from llmtrain.models.hf.registry import adapter_for_arch

LLMTRAIN_CONFIG = "llmtrain_config.yaml"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def read_llmtrain(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, tensors) of an llmtrain model directory."""
    path = Path(path)
    return _llmtrain_config(path), _read_weights(path / WEIGHTS)


def _llmtrain_config(path: Path) -> ModelConfig:
    cfg_file = path / LLMTRAIN_CONFIG
    try:
        raw = load_yaml(cfg_file.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ModelFormatError(f"{cfg_file} is unreadable ({err}); copy the model directory again") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ModelFormatError(f"{cfg_file}: expected a mapping with a 'model' section (a ModelConfig)")
    try:
        cfg = from_dict(ModelConfig, raw["model"], "model.")
        check_config(cfg)
    except ConfigError as err:
        raise ModelFormatError(f"{cfg_file}: {err}") from None
    return cfg


def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / HF_CONFIG
    try:
        return from_hf_config(json.loads(cfg_file.read_text()))
    except (OSError, ValueError, ConfigError) as err:
        raise ModelFormatError(f"{cfg_file}: {err}") from None


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of either kind of model directory, without reading its weights."""
    path = Path(path)
    return _llmtrain_config(path) if detect_format(path) == "llmtrain" else _hf_config(path)


def read_hf(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, Hugging Face-named tensors) of a Hugging Face model directory."""
    cfg, state = _read_hf_files(path)
    return adapter_for_arch(cfg.arch).state_config(cfg, state), state


def _read_hf_files(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    path = Path(path)
    cfg = _hf_config(path)
    index = path / HF_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ModelFormatError(
                f"{index} is unreadable or has no weight_map ({err}); copy the model directory again"
            ) from None
        state: Tensors = {}
        for shard in shards:
            state.update(_read_weights(path / shard))
        return cfg, state
    return cfg, _read_weights(path / WEIGHTS)


def _read_weights(file: Path) -> Tensors:
    if not file.is_file():
        raise ModelFormatError(f"{file} does not exist; a model directory needs its safetensors weights")
    try:
        return load_file(file)
    except (OSError, SafetensorError) as err:
        raise ModelFormatError(
            f"{file} is not a readable safetensors file ({err}); copy the model directory again"
        ) from None


def detect_format(path: str | os.PathLike) -> str:
    """'llmtrain' or 'hf' by the config file present, or an error naming the files looked for."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(f"model directory {path} does not exist; check the path")
    if (path / LLMTRAIN_CONFIG).is_file():
        return "llmtrain"
    if (path / HF_CONFIG).is_file():
        return "hf"
    raise ModelFormatError(
        f"{path} is neither an llmtrain model directory ({LLMTRAIN_CONFIG} + {WEIGHTS}) "
        f"nor a Hugging Face one ({HF_CONFIG} + {WEIGHTS}); a training checkpoint loads with "
        "llmtrain.from_pretrained"
    )


def read_any(path: str | os.PathLike) -> tuple[ModelConfig, Tensors]:
    """(config, llmtrain-named tensors) of either kind of model directory."""
    if detect_format(path) == "llmtrain":
        return read_llmtrain(path)
    cfg, hf_state = read_hf(path)
    return cfg, hf_to_llmtrain_state(cfg, hf_state, source=str(path))


def from_pretrained(
    path: str | os.PathLike, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> CausalLM:
    """Load an llmtrain or Hugging Face model directory; eval mode, like transformers' from_pretrained."""
    cfg, state = read_any(path)
    return model_from_state(cfg, state, device, dtype).eval()


def write_llmtrain(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    tokenizer_files: Mapping[str, bytes] | None = None,
) -> None:
    """Write an llmtrain model directory atomically, with the tokenizer's files beside the weights."""
    check_config(cfg)
    with _atomic_dir(path) as tmp:
        (tmp / LLMTRAIN_CONFIG).write_text(dump_yaml({"model": dataclasses.asdict(cfg)}))
        save_safetensors(dict(state), tmp / WEIGHTS)
        _write_files(tmp, tokenizer_files or {})


def write_hf(
    cfg: ModelConfig,
    hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_files: Mapping[str, bytes] | None = None,
    token_ids: Mapping[str, int | None] | None = None,
) -> None:
    """Write a Hugging Face model directory atomically, as transformers' save_pretrained lays it out.

    `hf_tensors` (Hugging Face names) may be a generator: tensors are written as they come, in safetensors
    files of at most `max_shard_bytes` with a `model.safetensors.index.json` when there is more than one.
    `tokenizer_files` are written beside them, and `token_ids` (bos/eos/pad_token_id) go into config.json
    and generation_config.json.
    """
    items = hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors
    with _atomic_dir(path) as tmp:
        files: list[tuple[Path, list[str]]] = []
        part: Tensors = {}
        size = total = 0
        dtype = None
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if part and size + nbytes > max_shard_bytes:
                files.append(_write_part(part, tmp, len(files)))
                part, size = {}, 0
            part[name] = tensor.contiguous()
            dtype = dtype or tensor.dtype
            size += nbytes
            total += nbytes
        if part or not files:
            files.append(_write_part(part, tmp, len(files)))
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
        hf_config = to_hf_config(cfg, dtype or torch.float32) | dict(token_ids or {})
        (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
        if token_ids:
            (tmp / GENERATION_CONFIG).write_text(json.dumps(dict(token_ids), indent=2) + "\n")
        _write_files(tmp, tokenizer_files or {})


def _write_part(part: Tensors, folder: Path, index: int) -> tuple[Path, list[str]]:
    file = folder / f"part-{index + 1}.safetensors"
    save_safetensors(part, file)
    return file, list(part)


def _write_files(folder: Path, files: Mapping[str, bytes]) -> None:
    for name, data in files.items():
        if (folder / name).exists():
            raise ModelFormatError(f"tokenizer file {name} would overwrite the model's own {name}")
        (folder / name).write_bytes(data)


def save_safetensors(tensors: Mapping[str, torch.Tensor], file: Path) -> None:
    """safetensors' save_file, leaving the file with the permissions any new file gets (0666 less the
    umask) instead of safetensors' private 0600: a model directory is for sharing."""
    file.touch()
    mode = stat.S_IMODE(file.stat().st_mode)
    save_file(dict(tensors), file, metadata={"format": "pt"})
    file.chmod(mode)


def save_pretrained(model: CausalLM, path: str | os.PathLike) -> None:
    """Save `model` as an llmtrain model directory."""
    write_llmtrain(model.config, model_state(model), path)


def save_hf(model: CausalLM, path: str | os.PathLike) -> None:
    """Save `model` as a Hugging Face directory that AutoModelForCausalLM.from_pretrained loads."""
    write_hf(model.config, llmtrain_to_hf_state(model.config, model_state(model)), path)


@contextlib.contextmanager
def _atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory to write into; on success it is renamed to `path`.

    An existing `path` is replaced only when it is empty or holds a model written before. The directory
    is made as any other (0777 less the umask), not private as tempfile makes it.
    """
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"output {path} exists and is not a directory; choose a new path")
        names = {p.name for p in path.iterdir()}
        if names and not names & {LLMTRAIN_CONFIG, HF_CONFIG}:
            raise ModelFormatError(
                f"output {path} is a non-empty directory that holds no model; choose a new path"
            )
    blocking = next((p for p in path.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ModelFormatError(f"output {path}: {blocking} is a file, not a directory; choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
