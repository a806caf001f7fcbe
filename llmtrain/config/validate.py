"""All consistency checks of a JobConfig, in one place.

`validate` checks what the config alone determines; `validate_world` adds what depends on the
number of processes the job runs on. Each message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from collections.abc import Sequence

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig, ModelConfig, ParallelConfig


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
    raise_if_problem(
        layer_plan_problem(m.num_layers, p.pp * p.virtual_stages, m.recompute_layers, p.stage_layers)
    )
    raise_if_problem(context_parallel_problem(job))
    raise_if_problem(float8_problem(job))
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
        _require(
            len(d.weights) == len(d.prefixes),
            f"data.weights has {len(d.weights)} entries but data.prefixes has {len(d.prefixes)}; "
            "give one weight per prefix",
        )
        _require(
            all(w >= 0 for w in d.weights) and sum(d.weights) > 0, "data.weights must be >= 0, not all zero"
        )
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
    _check_ranges(job)


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

    The loader has checked the types already. A field that may be negative would need an exception here.
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


def moe_problem(job: JobConfig) -> str:
    """Why the mixture-of-experts fields of `job` cannot run ("" if they can, or the arch is dense).

    What the experts do not support yet (DeepSpeed, fp8, router losses under full recompute) is refused
    here rather than failing (or silently mis-training) later; their tp limits are tensor_parallel_problem's,
    which checkpoint conversion and the planner ask too, and parallel.ep's expert_parallel_problem's.
    """
    m, p = job.model, job.parallel
    if not m.is_moe:
        return ""
    for name in ("num_experts", "num_experts_per_tok", "moe_layer_interval"):
        if getattr(m, name) < 1:
            return f"model.{name} must be at least 1 for model.arch={m.arch}; got {getattr(m, name)}"
    if m.num_experts_per_tok > m.num_experts:
        return (
            f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}; "
            "route each token to at most num_experts experts"
        )
    if m.num_shared_experts and m.arch not in ("ernie_moe", "deepseek_v3"):
        return (
            f"model.num_shared_experts={m.num_shared_experts}: model.arch={m.arch} has no shared experts "
            "(ernie_moe and deepseek_v3 have); set model.num_shared_experts=0"
        )
    routing = routing_problem(m)
    if routing:
        return routing
    if m.use_bias:
        return (
            f"model.arch={m.arch} has no biases (its experts and router have none); set model.use_bias=false"
        )
    bad = [i for i in m.dense_layers if not 0 <= i < m.num_layers]
    if bad:
        return (
            f"model.dense_layers names layer {bad[0]}, outside 0..{m.num_layers - 1} (model.num_layers="
            f"{m.num_layers}); list existing layers only"
        )
    unsupported = [
        (p.engine == "deepspeed", "parallel.engine=deepspeed", "parallel.engine=llmtrain"),
        (job.train.precision == "fp8", "train.precision=fp8", "train.precision bf16 or fp32"),
        # Reentrant checkpointing runs the forward without autograd, so the router statistics the
        # router losses are built from would carry no gradient.
        (
            (m.recompute == "full" or "full" in m.recompute_layers)
            and (m.router_aux_loss_coef > 0 or m.router_z_loss_coef > 0),
            ("model.recompute=full" if m.recompute == "full" else "full in model.recompute_layers")
            + " with router losses",
            "model.recompute none or selective (no full in model.recompute_layers), or "
            "model.router_aux_loss_coef=0 and router_z_loss_coef=0",
        ),
    ]
    for is_set, setting, fix in unsupported:
        if is_set:
            return (
                f"model.arch={m.arch} (mixture of experts) does not support {setting} yet; use {fix}, "
                "or a dense arch"
            )
    return ""


def expert_parallel_problem(job: JobConfig) -> str:
    """Why parallel.ep cannot shard `job`'s experts ("" if it can); the world-size part is
    expert_layout_problem."""
    m, p = job.model, job.parallel
    if p.ep < 1:
        return f"parallel.ep must be at least 1; got {p.ep}"
    if p.ep == 1:
        return ""
    if not m.is_moe:
        return (
            f"parallel.ep={p.ep} shards mixture-of-experts layers, but model.arch={m.arch} is dense; "
            "set parallel.ep=1 or use an MoE arch (mixtral, qwen3_moe, ernie_moe, deepseek_v3)"
        )
    if m.num_experts % p.ep:
        return (
            f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}; choose an ep dividing "
            "the expert count (every EP rank holds num_experts / ep experts)"
        )
    if p.zero_stage >= 2 and p.dp_shard is not None:
        return (
            f"parallel.ep={p.ep} with parallel.zero_stage={p.zero_stage} shards the experts over all the "
            "ranks holding them; hybrid sharding is not supported for them yet: set parallel.dp_shard=null"
        )
    if p.dp is not None:
        return expert_layout_problem(p, p.dp)
    return ""


def expert_layout_problem(p: ParallelConfig, dp: int) -> str:
    """Why parallel.ep cannot be carved out of the tp x cp x dp ranks at data-parallel degree `dp` ("" if it
    can). EP takes consecutive ranks of the expert domain, dp innermost, then cp, then tp
    (llmtrain.parallel.topology): it lies inside the dp ranks when ep divides dp, spans whole dp groups of
    several CP ranks when it is dp times a divisor of cp, and of several TP ranks beyond dp * cp."""
    if p.ep == 1:
        return ""
    inside = dp * p.cp
    if dp % p.ep == 0 or (p.ep % dp == 0 and p.cp % (p.ep // dp) == 0):
        return ""
    if p.ep % inside == 0 and p.tp % (p.ep // inside) == 0:
        return ""
    return (
        f"parallel.ep={p.ep} cannot be carved out of the tp x cp x dp = {p.tp}x{p.cp}x{dp} ranks; choose an "
        f"ep dividing the data-parallel degree {dp}, dp times a divisor of parallel.cp={p.cp}, or dp * cp = "
        f"{inside} times a divisor of parallel.tp={p.tp}"
    )


def routing_problem(m: ModelConfig) -> str:
    """Why the routing fields of MoE model `m` cannot work ("" if they can): groups, capacity, score bias."""
    if m.arch != "deepseek_v3":
        for name, default in (
            ("num_expert_groups", 1),
            ("topk_expert_groups", 1),
            ("routed_scaling_factor", 1.0),
        ):
            if getattr(m, name) != default:
                return (
                    f"model.{name}={getattr(m, name)}: model.arch={m.arch} has no group-limited, scaled "
                    f"sigmoid routing (deepseek_v3 has); set model.{name}={default}"
                )
    else:
        if m.num_kv_heads not in (None, m.num_attention_heads):
            return (
                f"model.num_kv_heads={m.num_kv_heads}: deepseek_v3's latent attention expands keys and "
                "values to every query head; set model.num_kv_heads=null"
            )
        groups, chosen = m.num_expert_groups, m.topk_expert_groups
        if m.num_experts % groups:
            return (
                f"model.num_expert_groups={groups} does not divide model.num_experts={m.num_experts}; "
                "choose a divisor"
            )
        size = m.num_experts // groups
        if groups > 1 and size < 2:
            return (
                f"model.num_expert_groups={groups} leaves {size} expert per group, but a group is ranked by "
                "its two best scores; use at most num_experts / 2 groups"
            )
        if chosen > groups:
            return (
                f"model.topk_expert_groups={chosen} exceeds model.num_expert_groups={groups}; "
                "choose at most num_expert_groups"
            )
        if m.num_experts_per_tok > chosen * size:
            return (
                f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds the {chosen * size} experts of "
                f"model.topk_expert_groups={chosen} groups of {size}; raise topk_expert_groups or lower top-k"
            )
    if m.moe_capacity_factor is not None and m.moe_capacity_factor < 1.0:
        return (
            f"model.moe_capacity_factor={m.moe_capacity_factor} gives the experts fewer slots than tokens "
            f"x top-k ({m.num_experts_per_tok}) even when perfectly balanced; use at least 1.0, or null "
            "(dropless)"
        )
    if m.bias_update_rate and m.arch not in ("ernie_moe", "deepseek_v3"):
        return (
            f"model.router_bias_update_rate={m.router_bias_update_rate}: model.arch={m.arch} routers have no "
            "score bias (ernie_moe and deepseek_v3 have); set it to 0 or null"
        )
    return ""


def engine_problem(job: JobConfig) -> str:
    """Why parallel.engine / parallel.offload cannot run this job, naming the field and the nearest layout
    that can ("" if they can). DeepSpeed wraps one whole, unsplit model: its ZeRO engine shards over data
    parallelism only, so llmtrain's tensor and pipeline parallelism stay with parallel.engine=llmtrain."""
    p = job.parallel
    if p.engine == "llmtrain":
        if p.offload != "none":
            return (
                f"parallel.offload={p.offload} needs parallel.engine=deepspeed (llmtrain's own engine keeps "
                "everything on the device); set parallel.engine=deepspeed or parallel.offload=none"
            )
        return ""
    if importlib.util.find_spec("deepspeed") is None:
        return (
            "parallel.engine=deepspeed needs the deepspeed package, which is not installed; "
            "run pip install 'llmtrain[deepspeed]' or set parallel.engine=llmtrain"
        )
    if p.tp > 1 or p.pp > 1:
        return (
            f"parallel.engine=deepspeed runs data parallelism only, not tp={p.tp} pp={p.pp}; use tp=1 pp=1 "
            "with every process in dp (the nearest layout), or parallel.engine=llmtrain for tp/pp"
        )
    if p.zero_stage not in (1, 2, 3):
        return (
            f"parallel.engine=deepspeed shards with ZeRO; set parallel.zero_stage to 1, 2 or 3 "
            f"(got {p.zero_stage}), or use parallel.engine=llmtrain for plain data parallelism"
        )
    if p.dp_shard is not None:
        return (
            f"parallel.dp_shard={p.dp_shard} (hybrid sharding) is FSDP2's, on parallel.engine=llmtrain; "
            "leave parallel.dp_shard null with parallel.engine=deepspeed, or use parallel.engine=llmtrain"
        )
    if p.grad_reduce == "step":
        return (
            "parallel.grad_reduce=step is FSDP2's, on parallel.engine=llmtrain; DeepSpeed reduces its "
            "gradients as it accumulates them: leave it at microbatch, or use parallel.engine=llmtrain"
        )
    if p.offload == "optimizer+params" and p.zero_stage != 3:
        return (
            f"parallel.offload=optimizer+params needs parallel.zero_stage=3 (only ZeRO-3 partitions the "
            f"parameters; got {p.zero_stage}); set zero_stage=3 or parallel.offload=optimizer"
        )
    if job.train.precision == "fp16":
        return (
            "train.precision=fp16 is not supported with parallel.engine=deepspeed (DeepSpeed's own loss "
            "scaler would disagree with llmtrain's bad-step skipping); use bf16 or parallel.engine=llmtrain"
        )
    if job.train.precision == "fp8":
        return (
            "train.precision=fp8 (torchao's Float8Linear) is wired into llmtrain's engine only; use "
            "train.precision=bf16 with parallel.engine=deepspeed, or parallel.engine=llmtrain for fp8"
        )
    return ""


def nvme_problem(p: ParallelConfig) -> str:
    """Why parallel.offload_device / parallel.nvme_path cannot run ("" if they can). DeepSpeed swaps to
    NVMe at zero stage 3 only (ZeRO-Infinity), through its async_io op, which builds against libaio."""
    if p.offload_device == "cpu":
        if p.nvme_path is not None:
            return (
                f"parallel.nvme_path={p.nvme_path} is read only with parallel.offload_device=nvme; set "
                "parallel.offload_device=nvme or leave parallel.nvme_path null"
            )
        return ""
    if p.engine != "deepspeed" or p.offload == "none":
        return (
            "parallel.offload_device=nvme says where parallel.offload puts what it offloads; set "
            "parallel.engine=deepspeed and parallel.offload=optimizer or optimizer+params, or "
            "parallel.offload_device=cpu"
        )
    if p.zero_stage != 3:
        return (
            f"parallel.offload_device=nvme needs parallel.zero_stage=3 (DeepSpeed swaps to NVMe at ZeRO-3 "
            f"only; got {p.zero_stage}); set zero_stage=3 or parallel.offload_device=cpu"
        )
    if not p.nvme_path:
        return (
            "parallel.offload_device=nvme needs parallel.nvme_path, a directory on a local NVMe drive for "
            "DeepSpeed's swap files"
        )
    if not async_io_available():
        return (
            "parallel.offload_device=nvme needs DeepSpeed's async_io op, which needs libaio (headers and "
            "library not found): apt install libaio-dev (yum install libaio-devel), or set "
            "parallel.offload_device=cpu"
        )
    return ""


def async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe swapping) can build here: it compiles a test against libaio."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def raise_if_problem(problem: str) -> None:
    """Raise ConfigError(problem) unless `problem` is empty: how callers enforce a *_problem verdict."""
    if problem:
        raise ConfigError(problem)


def tensor_parallel_problem(model: ModelConfig, tp: int, sequence_parallel: bool = False) -> str:
    """Why `model` cannot be split over `tp` tensor-parallel ranks, naming the field and the fix ("" if it
    can).

    The one statement of these rules: config validation, apply_tp, checkpoint conversion and the planner's
    search and cost model all ask here.
    """
    if tp < 1:
        return f"parallel.tp must be at least 1; got {tp}"
    if model.is_moe and model.seq_length % tp:
        return (
            f"model.seq_length={model.seq_length} is not divisible by parallel.tp={tp}: each TP rank "
            "routes its share of the sequence through the experts; make seq_length a multiple of tp"
        )
    heads, kv = model.num_attention_heads, model.kv_heads
    if heads % tp:
        return (
            f"parallel.tp={tp} does not divide model.num_attention_heads={heads}; "
            "choose a tp among its divisors"
        )
    if kv % tp and tp % kv:
        return (
            f"parallel.tp={tp} and model.num_kv_heads={kv}: one must divide the other (kv heads are split, "
            "or replicated when tp exceeds them); change tp or num_kv_heads"
        )
    if model.vocab_size % tp:
        return (
            f"model.vocab_size={model.vocab_size} is not divisible by parallel.tp={tp}; "
            "pad the vocabulary to a multiple of tp"
        )
    if model.ffn_size % tp:
        return (
            f"model.ffn_hidden_size={model.ffn_size} is not divisible by parallel.tp={tp}; "
            "make it a multiple of tp"
        )
    return sequence_parallel_problem(model.seq_length, tp) if sequence_parallel else ""


# torch._scaled_mm needs every GEMM dimension to be a multiple of 16: in and out features, and the token
# count, which is the reduction dimension of the weight gradient.
FP8_MULTIPLE = 16


def float8_problem(job: JobConfig) -> str:
    """Why `job` cannot train with train.precision=fp8 (llmtrain.parallel.float8), or '' when it can."""
    if job.train.precision != "fp8":
        return ""
    m, p, t = job.model, job.parallel, job.train
    if importlib.util.find_spec("torchao") is None:
        return "train.precision=fp8 needs torchao (pip install 'llmtrain[fp8]'); or use train.precision=bf16"
    if p.tp > 1:
        return (
            f"train.precision=fp8 swaps nn.Linear for torchao's Float8Linear, but parallel.tp={p.tp} uses "
            "llmtrain's own tensor-parallel layers; use parallel.tp=1 (data parallelism) or precision=bf16"
        )
    if p.pp > 1:
        return (
            f"train.precision=fp8 is verified without pipeline stages only; set parallel.pp=1 (got {p.pp}) "
            "or use train.precision=bf16"
        )
    if p.zero_stage >= 2:
        return (
            f"train.precision=fp8 is verified with the flat data-parallel buffers only, not with FSDP2's "
            f"parallel.zero_stage={p.zero_stage}; use parallel.zero_stage 0 or 1, or train.precision=bf16"
        )
    sizes = {
        "model.hidden_size": m.hidden_size,
        "model.ffn_hidden_size (resolved)": m.ffn_size,
        "model.num_attention_heads x head size": m.num_attention_heads * m.head_size,
        "model.num_kv_heads x head size": m.kv_heads * m.head_size,
        "train.micro_batch_size x model.seq_length (tokens per GEMM)": t.micro_batch_size * m.seq_length,
    }
    for name, value in sizes.items():
        if value % FP8_MULTIPLE:
            return (
                f"train.precision=fp8 needs {name} to be a multiple of {FP8_MULTIPLE} (float8 GEMMs); "
                f"got {value}; change it or use train.precision=bf16"
            )
    return ""


def sequence_parallel_problem(seq_length: int, tp: int) -> str:
    """Why a sequence of `seq_length` tokens cannot be sharded over `tp` ranks ("" if it can)."""
    if seq_length % tp:
        return (
            f"parallel.sequence_parallel needs model.seq_length={seq_length} divisible by parallel.tp={tp}; "
            "change one of them or set parallel.sequence_parallel=false"
        )
    return ""


def pipeline_problem(num_layers: int, pp: int, virtual_stages: int = 1, schedule: str | None = None) -> str:
    """Why `num_layers` layers cannot run as `pp` stages of `virtual_stages` chunks each under `schedule`
    (None: the layer split alone), naming the field and the fix; "" if they can.

    The one statement of these rules: config validation, pipeline stage splitting and the planner ask here.
    """
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if value < 1:
            return f"parallel.{name} must be at least 1; got {value}"
    chunks = pp * virtual_stages
    if chunks > num_layers:
        return (
            f"parallel.pp * parallel.virtual_stages = {chunks} exceeds model.num_layers={num_layers}; "
            "every model chunk needs at least one layer"
        )
    if schedule == "interleaved_1f1b" and pp == 1:
        return "parallel.schedule=interleaved_1f1b needs parallel.pp > 1"
    if schedule not in (None, "interleaved_1f1b") and virtual_stages > 1:
        return (
            f"parallel.virtual_stages={virtual_stages} needs parallel.schedule=interleaved_1f1b "
            f"(got {schedule}); set virtual_stages=1 or change the schedule"
        )
    return ""


def layer_plan_problem(
    num_layers: int, chunks: int, recompute_layers: Sequence[str], stage_layers: Sequence[int]
) -> str:
    """Why per-layer recomputation modes and layers per model chunk (empty: not set) do not fit a model of
    `num_layers` layers split into `chunks` = pp * virtual_stages chunks, naming the field and the fix ("" if
    they do). The one statement of these rules: config validation and the planner ask here."""
    if recompute_layers:
        if len(recompute_layers) != num_layers:
            return (
                f"model.recompute_layers has {len(recompute_layers)} entries for "
                f"model.num_layers={num_layers}; "
                "give one mode per layer, or leave it empty for model.recompute everywhere"
            )
        bad = sorted(set(recompute_layers) - {"none", "selective", "full"})
        if bad:
            return f"model.recompute_layers holds {bad[0]!r}; each entry must be none, selective or full"
    if stage_layers:
        if len(stage_layers) != chunks:
            return (
                f"parallel.stage_layers has {len(stage_layers)} entries for pp * virtual_stages = {chunks} "
                "model chunks; give one layer count per chunk, or leave it empty for the automatic split"
            )
        if min(stage_layers) < 1 or sum(stage_layers) != num_layers:
            return (
                f"parallel.stage_layers={list(stage_layers)} must be positive counts summing to "
                f"model.num_layers={num_layers}; every chunk needs at least one layer"
            )
    return ""


def context_parallel_problem(job: JobConfig) -> str:
    """Why the sequence cannot be split over parallel.cp context-parallel ranks, naming the field and the fix
    ("" if it can, or cp is 1). The one statement of these rules (llmtrain.parallel.context_parallel)."""
    m, p = job.model, job.parallel
    cp = p.cp
    if cp < 1:
        return f"parallel.cp must be at least 1; got {cp}"
    if cp == 1:
        return ""
    if m.seq_length % (2 * cp):
        return (
            f"model.seq_length={m.seq_length} is not divisible by 2 * parallel.cp = {2 * cp} (each CP rank "
            f"holds two mirrored chunks of the sequence); make seq_length a multiple of {2 * cp} or change cp"
        )
    if p.sequence_parallel and (m.seq_length // cp) % p.tp:
        return (
            f"parallel.sequence_parallel shards each CP rank's {m.seq_length // cp} tokens (model.seq_length "
            f"/ parallel.cp) over parallel.tp={p.tp}; make seq_length a multiple of cp * tp = {cp * p.tp}"
        )
    heads = m.num_attention_heads // max(p.tp, 1)
    if p.cp_comm == "all_to_all" and heads % cp:
        return (
            f"parallel.cp_comm=all_to_all scatters the attention heads over parallel.cp={cp} ranks, but "
            f"model.num_attention_heads={m.num_attention_heads} gives {heads} per tensor-parallel rank "
            f"(parallel.tp={p.tp}); choose a cp dividing {heads}, or parallel.cp_comm=ring"
        )
    if m.attention_dropout > 0:
        return (
            f"model.attention_dropout={m.attention_dropout}: context-parallel attention (parallel.cp={cp}) "
            "has no attention dropout; set model.attention_dropout=0 or parallel.cp=1"
        )
    unsupported = [
        (p.engine == "deepspeed", "parallel.engine=deepspeed", "parallel.engine=llmtrain"),
        (job.train.precision == "fp8", "train.precision=fp8", "train.precision bf16 or fp32"),
    ]
    for is_set, setting, fix in unsupported:
        if is_set:
            return f"parallel.cp={cp} (context parallelism) does not support {setting} yet; use {fix} or cp=1"
    return ""


def uneven_batch_problem(job: JobConfig, dp: int | None = None) -> str:
    """Why train.dp_micro_batches (micro-batches per data-parallel replica) cannot run this job, naming the
    fix ("" if it can, or is empty). `dp`: the data-parallel degree once the world size is known. Uneven
    counts are verified against one process with llmtrain's own data parallelism (zero 0/1, whose gradient
    reduction divides by dp, which the runner's loss weighting relies on) and without pipeline, context or
    expert parallelism: the pipeline schedule is built for one micro-batch count on every replica, and the
    other paths (FSDP2, DeepSpeed, cp, ep) have not been checked with uneven shares."""
    t, p = job.train, job.parallel
    counts = t.dp_micro_batches
    if not counts:
        return ""
    total = t.global_batch_size // t.micro_batch_size
    if min(counts) < 1 or sum(counts) != total:
        return (
            f"train.dp_micro_batches={list(counts)} must be positive counts summing to "
            f"train.global_batch_size / train.micro_batch_size = {total}; every replica runs at least one"
        )
    unsupported = [
        (p.engine != "llmtrain", f"parallel.engine={p.engine}", "parallel.engine=llmtrain"),
        (p.zero_stage > 1, f"parallel.zero_stage={p.zero_stage}", "parallel.zero_stage 0 or 1"),
        (p.pp > 1, f"parallel.pp={p.pp}", "parallel.pp=1"),
        (p.cp > 1, f"parallel.cp={p.cp}", "parallel.cp=1"),
        (p.ep > 1, f"parallel.ep={p.ep}", "parallel.ep=1"),
    ]
    for bad, setting, fix in unsupported:
        if bad:
            return (
                f"train.dp_micro_batches (uneven micro-batches per replica) is not supported with {setting}; "
                f"use {fix}, or leave train.dp_micro_batches empty for equal shares"
            )
    if dp is not None and len(counts) != dp:
        return (
            f"train.dp_micro_batches has {len(counts)} entries for the data-parallel degree {dp}; give one "
            "micro-batch count per replica"
        )
    return ""


def zero_problem(p: ParallelConfig) -> str:
    """Why the zero stage cannot run with the rest of the layout ("" when it can)."""
    if p.dp_shard is not None and p.dp_shard < 1:
        return f"parallel.dp_shard must be at least 1 or null (= dp); got {p.dp_shard}"
    if p.dp_shard is not None and p.zero_stage < 2:
        return (
            f"parallel.dp_shard={p.dp_shard} (hybrid sharding) needs parallel.zero_stage 2 or 3 (FSDP2); "
            f"zero_stage {p.zero_stage} shards over the whole DP group: set parallel.dp_shard=null"
        )
    if p.grad_reduce == "step" and p.zero_stage < 2:
        return (
            f"parallel.grad_reduce=step chooses how FSDP2 (parallel.zero_stage 2 or 3) accumulates; "
            f"zero_stage {p.zero_stage} already reduces once a step into its flat gradient buffer: leave "
            "it at microbatch"
        )
    return ""


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
