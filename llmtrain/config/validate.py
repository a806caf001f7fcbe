"""All consistency checks of a JobConfig, in one place.

`validate` checks what the config alone determines; `validate_world` adds what depends on the
number of processes the job runs on. Each message names the field and the fix.
"""

from __future__ import annotations

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig, ParallelConfig


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(job: JobConfig) -> None:
    """Raise ConfigError on the first impossible value or combination."""
    m, p, t = job.model, job.parallel, job.train
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
        _require(getattr(m, name) > 0, f"model.{name} must be positive; got {getattr(m, name)}")
    _require(m.kv_heads > 0, f"model.num_kv_heads must be positive; got {m.num_kv_heads}")
    _require(
        m.num_attention_heads % m.kv_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_kv_heads="
        f"{m.kv_heads}; choose num_kv_heads among the divisors of num_attention_heads",
    )
    if m.head_dim is None:
        _require(
            m.hidden_size % m.num_attention_heads == 0,
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; change one of them or set model.head_dim explicitly",
        )
    if m.arch != "gpt":
        _require(m.head_size % 2 == 0, f"rotary embeddings need an even head size; got {m.head_size}")
    _require(m.ffn_size > 0, f"model.ffn_hidden_size must be positive; got {m.ffn_hidden_size}")
    _require(
        m.max_positions >= m.seq_length,
        f"model.max_position_embeddings={m.max_positions} is below model.seq_length={m.seq_length}; "
        "raise it or shorten the sequence",
    )
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        _require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1); got {value}")

    for name in ("tp", "pp", "virtual_stages"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be at least 1; got {getattr(p, name)}")
    _require(p.dp is None or p.dp >= 1, f"parallel.dp must be at least 1 or null; got {p.dp}")
    _require(p.zero_stage in (0, 1), f"parallel.zero_stage must be 0 or 1; got {p.zero_stage}")
    rank_order(p)
    _require(
        p.backend in ("auto", "gloo", "nccl"),
        f"parallel.backend must be auto, gloo or nccl; got {p.backend!r}",
    )
    _check_tensor_parallel(job)
    _check_pipeline(job)

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

    d = job.data
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
        len(shares) == 3 and all(s >= 0 for s in shares) and shares[0] > 0,
        f"data.split must be three non-negative train,valid,test proportions like 98,2,0; got {d.split!r}",
    )

    c = job.checkpoint
    _require(c.interval >= 0, f"checkpoint.interval must be >= 0 (0: only at the end); got {c.interval}")
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


def _check_tensor_parallel(job: JobConfig) -> None:
    m, tp = job.model, job.parallel.tp
    _require(
        m.num_attention_heads % tp == 0,
        f"parallel.tp={tp} does not divide model.num_attention_heads={m.num_attention_heads}; "
        "choose a tp among its divisors",
    )
    _require(
        m.kv_heads % tp == 0 or tp % m.kv_heads == 0,
        f"parallel.tp={tp} and model.num_kv_heads={m.kv_heads}: one must divide the other "
        "(kv heads are split, or replicated when tp exceeds them)",
    )
    _require(
        m.vocab_size % tp == 0,
        f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp}; "
        "pad the vocabulary to a multiple of tp",
    )
    _require(
        m.ffn_size % tp == 0,
        f"model.ffn_hidden_size={m.ffn_size} is not divisible by parallel.tp={tp}",
    )
    if job.parallel.sequence_parallel:
        _require(
            m.seq_length % tp == 0,
            f"parallel.sequence_parallel needs model.seq_length={m.seq_length} divisible by parallel.tp={tp}",
        )


def _check_pipeline(job: JobConfig) -> None:
    p, layers = job.parallel, job.model.num_layers
    chunks = p.pp * p.virtual_stages
    _require(
        chunks <= layers,
        f"parallel.pp * parallel.virtual_stages = {chunks} exceeds model.num_layers={layers}; "
        "every model chunk needs at least one layer",
    )
    if p.schedule == "interleaved_1f1b":
        _require(p.pp > 1, "parallel.schedule=interleaved_1f1b needs parallel.pp > 1")
    elif p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved_1f1b "
            f"(got {p.schedule}); set virtual_stages=1 or change the schedule"
        )


def rank_order(p: ParallelConfig) -> list[str]:
    """parallel.order as a list of dimensions, innermost first; it must name tp, dp and pp once each."""
    named = p.order.split("-")
    _require(
        sorted(named) == ["dp", "pp", "tp"],
        f"parallel.order must name tp, dp and pp once each, innermost first (e.g. tp-dp-pp); got {p.order!r}",
    )
    return named


def resolve_dp(p: ParallelConfig, world_size: int) -> int:
    """The data-parallel degree for `world_size` processes, checking that the degrees multiply out."""
    model_parallel = p.tp * p.pp
    if p.dp is None:
        _require(
            world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {model_parallel}; "
            "launch a multiple of that many processes or change the degrees",
        )
        return world_size // model_parallel
    _require(
        model_parallel * p.dp == world_size,
        f"parallel.tp * parallel.pp * parallel.dp = {p.tp}*{p.pp}*{p.dp} = {model_parallel * p.dp} "
        f"but the job runs on {world_size} processes; "
        "make the product equal the world size (or set parallel.dp=null)",
    )
    return p.dp


def validate_world(job: JobConfig, world_size: int) -> int:
    """Checks that depend on the world size; returns the data-parallel degree."""
    dp = resolve_dp(job.parallel, world_size)
    t = job.train
    per_step = t.micro_batch_size * dp
    _require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size * dp = "
        f"{t.micro_batch_size}*{dp}; change the batch sizes",
    )
    return dp
