"""All consistency checks of a JobConfig: `validate` runs every one of them, in one place.

`validate` checks what the config alone determines; `validate_world` adds what depends on the
number of processes the job runs on. Each message names the field and the fix. The rules that other
layers ask too (llmtrain.parallel, llmtrain.pipeline, the planner) are stated once each, by section:
llmtrain.config.layout_rules (tp, sp, pp, cp, zero, uneven batches), llmtrain.config.moe_rules (experts,
routing, ep), llmtrain.config.mtp_rules (multi-token prediction) and llmtrain.config.engine_rules
(DeepSpeed, offload, fp8); this module checks the single fields and the train, data, checkpoint and logging
sections itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing

from llmtrain.config.engine_rules import compile_problem, engine_problem, float8_problem, nvme_problem
from llmtrain.config.errors import ConfigError
from llmtrain.config.layout_rules import (
    context_parallel_problem,
    layer_plan_problem,
    microbatch_problem,
    pipeline_problem,
    tensor_parallel_problem,
    uneven_batch_problem,
    zero_problem,
)
from llmtrain.config.moe_rules import expert_layout_problem, expert_parallel_problem, moe_problem
from llmtrain.config.mtp_rules import mtp_problem
from llmtrain.config.optimizer_rules import optimizer_problem
from llmtrain.config.schema import JobConfig, ParallelConfig


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(job: JobConfig) -> None:
    """Raise ConfigError on the first impossible value or combination."""
    _check_choices(job)
    m, p, t = job.model, job.parallel, job.train
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
        _require(getattr(m, name) > 0, f"model.{name} must be positive; got {getattr(m, name)}")
    _require(m.kv_heads > 0, f"model.num_kv_heads must be positive; got {m.num_kv_heads}")
    _require(
        m.num_attention_heads % m.kv_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_kv_heads="
        f"{m.kv_heads}; choose num_kv_heads among the divisors of num_attention_heads",
    )
    if m.head_dim is None and m.arch != "deepseek_v3":  # its head widths are the qk_*/v_head_dim fields
        _require(
            m.hidden_size % m.num_attention_heads == 0,
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; change one of them or set model.head_dim explicitly",
        )
    _require(
        m.rope_scaling == "none" or m.arch == "deepseek_v3",
        f"model.rope_scaling={m.rope_scaling} is implemented for deepseek_v3 only; set it to none",
    )
    if m.arch == "deepseek_v3":
        _require(
            m.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs); change it",
        )
    elif m.arch != "gpt":
        _require(
            m.head_size % 2 == 0,
            f"model.arch={m.arch} (rotary embeddings) needs an even head size; got {m.head_size} "
            "(model.head_dim, or model.hidden_size / model.num_attention_heads); change them or use gpt",
        )
    _require(m.ffn_size > 0, f"model.ffn_hidden_size must be positive; got {m.ffn_hidden_size}")
    _require(
        m.max_positions >= m.seq_length,
        f"model.max_position_embeddings={m.max_positions} is below model.seq_length={m.seq_length}; "
        "raise it or shorten the sequence",
    )
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        _require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1); got {value}")
    raise_if_problem(moe_problem(job))
    raise_if_problem(expert_parallel_problem(job))
    raise_if_problem(mtp_problem(job))

    _require(p.dp is None or p.dp >= 1, f"parallel.dp must be at least 1 or null; got {p.dp}")
    _require(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage must be 0, 1, 2 or 3; got {p.zero_stage}")
    raise_if_problem(zero_problem(p))
    raise_if_problem(engine_problem(job))
    raise_if_problem(nvme_problem(p))
    rank_order(p)
    _require(
        p.backend in ("auto", "gloo", "nccl"),
        f"parallel.backend must be auto, gloo or nccl; got {p.backend!r}",
    )
    raise_if_problem(tensor_parallel_problem(m, p.tp, p.sequence_parallel))
    raise_if_problem(pipeline_problem(m.num_layers, p.pp, p.virtual_stages, p.schedule))
    if p.dp and t.micro_batch_size >= 1 and p.pp > 1:  # the micro-batch count is known once dp is
        num_micro = t.global_batch_size // (t.micro_batch_size * p.dp)
        raise_if_problem(microbatch_problem(p.schedule, p.pp, num_micro, p.virtual_stages))
    raise_if_problem(
        layer_plan_problem(m.num_layers, p.pp * p.virtual_stages, m.recompute_layers, p.stage_layers)
    )
    raise_if_problem(context_parallel_problem(job))
    raise_if_problem(float8_problem(job))
    raise_if_problem(compile_problem(job))
    raise_if_problem(uneven_batch_problem(job))

    _require(t.steps >= 1, f"train.steps must be at least 1; got {t.steps}")
    _require(t.lr > 0, f"train.lr must be positive; got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must lie in [0, train.lr={t.lr}]")
    _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0; got {t.warmup_steps}")
    _require(t.micro_batch_size >= 1, f"train.micro_batch_size must be at least 1; got {t.micro_batch_size}")
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
        f"{t.micro_batch_size}; make it one",
    )
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables); got {t.grad_clip}")
    _require(t.max_bad_steps >= 1, f"train.max_bad_steps must be at least 1; got {t.max_bad_steps}")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(t, name) < 1, f"train.{name} must be in [0, 1); got {getattr(t, name)}")
    raise_if_problem(optimizer_problem(job))
    _require(t.hang_timeout_s > 0, f"train.hang_timeout_s must be positive (seconds); got {t.hang_timeout_s}")
    _require(
        t.loss_spike_factor == 0 or t.loss_spike_factor > 1,
        f"train.loss_spike_factor must be above 1 (or 0 to disable); got {t.loss_spike_factor}",
    )
    _require(
        t.loss_spike_window >= 1, f"train.loss_spike_window must be at least 1; got {t.loss_spike_window}"
    )
    _require(
        t.straggler_factor == 0 or t.straggler_factor > 1,
        f"train.straggler_factor must be above 1 (or 0 to disable); got {t.straggler_factor}",
    )

    d = job.data
    _require(
        not d.reset_attention_mask or p.pp == 1,
        f"data.reset_attention_mask (packed documents) is not supported with pipeline stages yet "
        f"(parallel.pp={p.pp}); set parallel.pp=1 or data.reset_attention_mask=false",
    )
    if d.weights:
        entries = len(d.prefixes) + len(d.sources)
        _require(
            len(d.weights) == entries,
            f"data.weights has {len(d.weights)} entries but data.prefixes and data.sources have {entries}; "
            "give one weight per prefix, then one per source",
        )
        _require(
            all(w >= 0 for w in d.weights) and sum(d.weights) > 0, "data.weights must be >= 0, not all zero"
        )
    _require(bool(d.text_key), "data.text_key must name the field holding the text (e.g. text)")
    parts = d.split.split(",")
    try:
        shares = [float(x) for x in parts]
    except ValueError:
        shares = []
    _require(
        len(shares) == 3 and all(math.isfinite(s) and s >= 0 for s in shares) and shares[0] > 0,
        f"data.split must be three non-negative train,valid,test proportions like 98,2,0; got {d.split!r}",
    )
    _require(
        shares[1] > 0 or t.eval_interval == 0,
        f"data.split={d.split!r} gives the valid split no share but train.eval_interval={t.eval_interval} "
        "evaluates on it; give valid a share (e.g. 98,2,0) or set train.eval_interval=0",
    )

    c = job.checkpoint
    _require(c.interval >= 0, f"checkpoint.interval must be >= 0 (0: no step-based saves); got {c.interval}")
    _require(
        c.interval_minutes >= 0,
        f"checkpoint.interval_minutes must be >= 0 (0: no time-based saves); got {c.interval_minutes}",
    )
    _require(c.keep >= 1, f"checkpoint.keep must be at least 1; got {c.keep}")

    lg = job.logging
    _require(lg.interval >= 1, f"logging.interval must be at least 1; got {lg.interval}")
    _require(
        not lg.profile_steps or (len(lg.profile_steps) == 2 and lg.profile_steps[0] <= lg.profile_steps[1]),
        f"logging.profile_steps must be [first, last]; got {lg.profile_steps}",
    )
    _require(
        lg.peak_tflops is None or lg.peak_tflops > 0,
        f"logging.peak_tflops must be positive; got {lg.peak_tflops}",
    )
    raise_if_problem(wandb_problem(job))
    _check_ranges(job)


def wandb_problem(job: JobConfig) -> str:
    """Why logging.wandb cannot log (asked now, not at the first logged step hours later), or ''."""
    w = job.logging.wandb
    if w.project is None:
        given = [f"logging.wandb.{name}" for name in ("name", "entity") if getattr(w, name) is not None]
        given += ["logging.wandb.tags"] if w.tags else []
        if given:
            return (
                f"{given[0]} is set but logging.wandb.project is not; set logging.wandb.project to log to W&B"
            )
        return ""
    if importlib.util.find_spec("wandb") is None:
        return (
            f"logging.wandb.project={w.project} needs the wandb package, which is not installed; run pip "
            "install 'llmtrain[wandb]', or leave logging.wandb.project unset"
        )
    return ""


# Number fields whose 0 is out of range and that no rule in `validate` bounds already: sizes, rates and times
# without an "off" meaning (for the optional sizes, 0 would silently mean null).
_POSITIVE = frozenset(
    {
        "model.num_kv_heads",
        "model.head_dim",
        "model.ffn_hidden_size",
        "model.moe_ffn_hidden_size",
        "model.num_experts",
        "model.num_experts_per_tok",
        "model.moe_layer_interval",
        "model.num_expert_groups",
        "model.topk_expert_groups",
        "model.routed_scaling_factor",
        "model.moe_capacity_factor",
        "model.q_lora_rank",
        "model.kv_lora_rank",
        "model.qk_rope_head_dim",
        "model.v_head_dim",
        "model.max_position_embeddings",
        "model.norm_eps",
        "model.rope_theta",
        "model.rope_scaling_factor",
        "model.rope_original_max_positions",
        "parallel.dp_bucket_mb",
        "train.global_batch_size",
        "train.adam_eps",
        "train.initial_loss_scale",
        "train.eval_batches",
    }
)
# Number fields that may be negative: the Newton-Schulz polynomial's coefficients (b < 0 by design).
_SIGNED = frozenset({"train.muon_ns_coefficients"})
# Whole numbers reach torch and numpy as int64 (seeds, steps, sizes).
_INT64_MAX = 2**63 - 1


def _check_choices(section: object, prefix: str = "") -> None:
    """Every field typed as a Literal holds one of its choices. The loader checks that too, but a config
    built or changed in code reaches validate without the loader, and the rules below read these fields."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, name = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{name}.")
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            choices = typing.get_args(hints[f.name])
            _require(value in choices, f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_ranges(section: object, prefix: str = "") -> None:
    """The rules every field obeys, read from the dataclasses so that a field added later obeys them too:
    a number (or list item) is >= 0 (> 0 in _POSITIVE) and a whole one fits an int64; a string is not empty.

    The loader has checked the types already. A field that may be negative is in _SIGNED.
    """
    for f in dataclasses.fields(section):
        value, name = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_ranges(value, f"{name}.")
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            where = name if index is None else f"{name}[{index}]"
            if isinstance(item, str) and not item.strip():
                default = "null" if f.default is None else repr(f.default)
                keep = (
                    f" or leave {name} out (default: {default})"
                    if f.default is not dataclasses.MISSING
                    else ""
                )
                raise ConfigError(f"{where} is empty; give a value{keep}")
            if not isinstance(item, (int, float)) or isinstance(item, bool):
                continue
            if name in _SIGNED:
                continue
            if name in _POSITIVE:
                _require(
                    item > 0,
                    f"{where} must be {'at least 1' if type(item) is int else 'positive'}; got {item}",
                )
            else:
                _require(item >= 0, f"{where} must be >= 0; got {item}")
            _require(
                type(item) is float or item <= _INT64_MAX, f"{where} must be at most 2**63-1; got {item}"
            )


def raise_if_problem(problem: str) -> None:
    """Raise ConfigError(problem) unless `problem` is empty: how callers enforce a *_problem verdict."""
    if problem:
        raise ConfigError(problem)


def rank_order(p: ParallelConfig) -> list[str]:
    """parallel.order as a list of dimensions, innermost first; it must name tp, dp and pp once each, and may
    name cp. An unnamed cp goes just inside dp: a CP group's ranks sit between a TP group's and a DP group's
    (tp-dp-pp reads as tp-cp-dp-pp)."""
    named = p.order.split("-")
    _require(
        sorted(named) in (["dp", "pp", "tp"], ["cp", "dp", "pp", "tp"]),
        f"parallel.order must name tp, dp and pp once each (and cp at most once), innermost first "
        f"(e.g. tp-dp-pp or tp-cp-dp-pp); got {p.order!r}",
    )
    if "cp" not in named:
        named.insert(named.index("dp"), "cp")
    return named


def resolve_dp(p: ParallelConfig, world_size: int) -> int:
    """The data-parallel degree for `world_size` processes, checking that the degrees multiply out."""
    model_parallel = p.tp * p.cp * p.pp
    if p.dp is None:
        _require(
            world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by parallel.tp * parallel.cp * parallel.pp = "
            f"{model_parallel}; launch a multiple of that many processes or change the degrees",
        )
        return world_size // model_parallel
    _require(
        model_parallel * p.dp == world_size,
        f"parallel.tp * parallel.cp * parallel.pp * parallel.dp = {p.tp}*{p.cp}*{p.pp}*{p.dp} = "
        f"{model_parallel * p.dp} but the job runs on {world_size} processes; "
        "make the product equal the world size (or set parallel.dp=null)",
    )
    return p.dp


def validate_world(job: JobConfig, world_size: int) -> int:
    """Checks that depend on the world size; returns the data-parallel degree."""
    dp = resolve_dp(job.parallel, world_size)
    t = job.train
    per_step = t.micro_batch_size * dp
    raise_if_problem(uneven_batch_problem(job, dp))
    _require(
        bool(t.dp_micro_batches) or t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size * dp = "
        f"{t.micro_batch_size}*{dp}; change the batch sizes",
    )
    raise_if_problem(expert_layout_problem(job.parallel, dp))
    shard = job.parallel.dp_shard
    _require(
        shard is None or dp % shard == 0,
        f"parallel.dp_shard={shard} does not divide the data-parallel degree {dp}; choose a divisor of it "
        "(or null to shard over all of DP)",
    )
    return dp
