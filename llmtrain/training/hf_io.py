"""Hugging Face in and out of a run: checkpoint.load=<model directory> and checkpoint.export_hf=true.

In: a launch whose checkpoint.load is a Hugging Face model directory (config.json + safetensors; an llmtrain
model directory works alike) starts at step 0 from its weights, and with data.tokenizer unset trains with
the directory's tokenizer (`with_model_tokenizer`). The model section must describe that model:
`check_model_dir` (at plan time, reading config.json only) names every field to set, all at once. Rank 0
then converts the directory with llmtrain.checkpoint.convert.from_hf into a step-0 checkpoint chunked for the
run's (tp, pp, dp) layout, in a hidden directory beside output_dir (on the file system every rank shares),
every rank loads it as any checkpoint (any tp, pp, ep, zero stage or engine), and rank 0 removes it.

Out: with checkpoint.export_hf=true a run that reaches train.steps also writes its final checkpoint, with its
tokenizer, as a Hugging Face model directory <output_dir>/hf/step_<N>/ (convert.to_hf), which
AutoModelForCausalLM and AutoTokenizer load. An existing directory is never replaced: a second export of the
same step (a run continued from an earlier checkpoint) goes to step_<N>-2, -3, ...
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmtrain.checkpoint.directory import MOE_SHAPE_FIELDS, SHAPE_FIELDS, is_checkpoint, model_directory_kind
from llmtrain.config import ConfigError, JobConfig, ModelConfig, with_overrides
from llmtrain.errors import UserError
from llmtrain.models.hf import read_config, to_hf_config

EXPORT_DIR = "hf"
# Beyond the tensor shapes: the fields that change what the model computes from its weights (training
# choices such as dropout, init_std, kernels or the router's loss coefficients are the run's own).
FUNCTION_FIELDS = (
    ("max_position_embeddings", "max_positions"),
    ("norm_eps", "norm_eps"),
    ("rope_theta", "rope_theta"),
)
MOE_FUNCTION_FIELDS = (
    ("num_experts_per_tok", "num_experts_per_tok"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("routed_scaling_factor", "routed_scaling_factor"),
    ("num_expert_groups", "num_expert_groups"),
    ("topk_expert_groups", "topk_expert_groups"),
)


def is_model_dir(path: str | Path) -> bool:
    """Whether checkpoint.load names a model directory (Hugging Face or llmtrain) rather than a checkpoint."""
    path = Path(path)
    return path.is_dir() and not is_checkpoint(path) and model_directory_kind(path) is not None


def _shown(value: object) -> str:
    """A value as a key.path=value override reads it back."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_model_dir(path: Path, model: ModelConfig) -> None:
    """Raise naming, as overrides, every model field in which the model directory `path` differs from the
    job's model section (its config only is read)."""
    saved = read_config(path)
    fields = SHAPE_FIELDS + FUNCTION_FIELDS
    if saved.is_moe:
        fields += MOE_SHAPE_FIELDS + MOE_FUNCTION_FIELDS
    wrong = [
        f"model.{f}={_shown(getattr(saved, p))}" for f, p in fields if getattr(saved, p) != getattr(model, p)
    ]
    if saved.is_moe and saved.arch == model.arch:
        wrong += [
            f"model.{f}={_shown(getattr(saved, f))}"
            for f in ("moe_layer_start", "moe_layer_interval", "dense_layers")
            if getattr(saved, f) != getattr(model, f)
        ]
    if wrong:
        raise ConfigError(
            f"checkpoint.load={path} is {model_directory_kind(path)} whose model differs from this job's "
            f"model section; set {' '.join(wrong)}"
        )


def with_model_tokenizer(job: JobConfig, model_dir: str) -> JobConfig:
    """With data.tokenizer unset, the job training with the model directory's own tokenizer, if it has one:
    the ids its weights were trained on (rather than a tokenizer trained afresh on the corpus)."""
    from llmtrain.checkpoint.convert import tokenizer_source

    source = tokenizer_source(Path(model_dir)) if job.data.tokenizer is None else None
    return job if source is None else with_overrides(job, {"data.tokenizer": str(source)})


def check_export(job: JobConfig) -> None:
    """checkpoint.export_hf: refuse, before training, a model transformers has no class for."""
    if job.checkpoint.export_hf:
        try:
            to_hf_config(job.model)
        except UserError as err:
            raise ConfigError(f"checkpoint.export_hf=true: {err}; set checkpoint.export_hf=false") from None


def import_dir(job: JobConfig) -> Path:
    """Where rank 0 converts checkpoint.load's model directory for this run: beside output_dir."""
    out = Path(job.output_dir).absolute()
    return out.parent / f".{out.name}.hf_import"


def convert_model_dir(job: JobConfig, model_dir: str, tp: int, pp: int, dp: int) -> Path:
    """Rank 0: `model_dir` as a step-0 checkpoint chunked for (tp, pp, dp) in `import_dir(job)`."""
    from llmtrain.checkpoint.convert import from_hf

    target = import_dir(job)
    shutil.rmtree(target, ignore_errors=True)  # left by a launch killed while converting
    return from_hf(model_dir, target, tp, pp, dp)


def remove_import(job: JobConfig) -> None:
    shutil.rmtree(import_dir(job), ignore_errors=True)


def export(job: JobConfig, checkpoint: str | Path, step: int) -> Path:
    """Rank 0: the checkpoint as a new Hugging Face model directory <output_dir>/hf/step_<step>[-k]."""
    from llmtrain.checkpoint.convert import to_hf

    root = Path(job.output_dir) / EXPORT_DIR
    target, k = root / f"step_{step}", 1
    while target.exists():
        k += 1
        target = root / f"step_{step}-{k}"
    to_hf(checkpoint, target)
    return target
