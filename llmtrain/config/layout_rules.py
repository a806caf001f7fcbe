"""Whether a model fits a parallel layout: tensor and sequence parallelism, pipeline stages and their layer
plans, context parallelism, the ZeRO stage with hybrid sharding, uneven micro-batches per replica.

Each *_problem function is the one statement of its rule: it returns "" when the layout works, else the
message naming the field and the fix. Config validation (llmtrain.config.validate), llmtrain.parallel,
llmtrain.pipeline, checkpoint conversion and the planner all ask the same function.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmtrain.config.schema import JobConfig, ModelConfig, ParallelConfig


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
    if schedule in CHUNKED_SCHEDULES and pp == 1:
        return f"parallel.schedule={schedule} needs parallel.pp > 1"
    return schedule_problem(schedule, pp, virtual_stages) if schedule is not None else ""


V_SCHEDULES = ("zb_v", "dualpipe_v")
"""Pipeline schedules placing two chunks per rank in a V (rank r: stages r and 2 pp - 1 - r)."""
CHUNKED_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")
"""Pipeline schedules taking any number of chunks per rank (parallel.virtual_stages)."""


def schedule_problem(schedule: str, pp: int, virtual_stages: int) -> str:
    """Why `schedule` cannot run on `pp` ranks of `virtual_stages` chunks each, naming the field and what
    works ("" if it can)."""
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if value < 1:
            return f"parallel.{name} must be at least 1; got {value}"
    if schedule in V_SCHEDULES:
        if pp == 1:
            return (
                f"parallel.schedule={schedule} places two chunks per rank in a V across ranks and needs "
                "parallel.pp > 1; use parallel.schedule=1f1b for one pipeline rank"
            )
        if virtual_stages != 2:
            return (
                f"parallel.schedule={schedule} runs exactly two chunks per rank (a V); set "
                f"parallel.virtual_stages=2 (got {virtual_stages})"
            )
        return ""
    if schedule not in CHUNKED_SCHEDULES and virtual_stages > 1:
        return (
            f"parallel.virtual_stages={virtual_stages} needs parallel.schedule=interleaved_1f1b or "
            f"interleaved_zb (got {schedule}); set virtual_stages=1 or change the schedule"
        )
    return ""


def microbatch_problem(schedule: str, pp: int, num_micro: int, virtual_stages: int) -> str:
    """Why `schedule` cannot run `num_micro` micro-batches per step on `pp` ranks ("" if it can), naming
    the fields and the counts that work."""
    counted = "train.global_batch_size / (train.micro_batch_size * dp)"
    if schedule in CHUNKED_SCHEDULES and virtual_stages > 1 and num_micro < pp:
        return (
            f"parallel.schedule={schedule} needs at least parallel.pp={pp} micro-batches per step; got "
            f"{num_micro}. Raise {counted} to >= {pp}, lower parallel.pp, or use parallel.schedule=zb_v "
            "(any count)"
        )
    if schedule == "dualpipe_v" and num_micro < 2 * pp:
        return (
            f"parallel.schedule=dualpipe_v needs at least 2 * parallel.pp = {2 * pp} micro-batches per "
            f"step; got {num_micro}. Raise {counted} to >= {2 * pp}, or use parallel.schedule=zb_v "
            "(any count)"
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
    if p.engine == "deepspeed":
        return (
            f"parallel.cp={cp} (context parallelism) does not support parallel.engine=deepspeed yet; use "
            "parallel.engine=llmtrain or cp=1"
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
    if p.dp_reduce == "tree" and (p.zero_stage != 0 or p.engine != "llmtrain"):
        return (
            f"parallel.dp_reduce=tree sums whole gradient buffers (llmtrain's zero_stage 0); got "
            f"zero_stage {p.zero_stage}, engine {p.engine}: set zero_stage=0 or dp_reduce=all_reduce"
        )
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
