"""One training job from a config: the flow described in docs/architecture.md, wired in one place.

A launch writes nothing before every check has passed: the config (on load), the world size (on joining
the processes), the output directory's state (`plan_launch`: refuse, resume, archive or start fresh),
the data, the model and the checkpoint it starts from. Only then does rank 0 commit the launch to
output_dir and print the startup block.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from llmtrain.config import ConfigError, JobConfig, with_overrides
from llmtrain.config.engine_rules import float8_all_gather
from llmtrain.errors import UserError
from llmtrain.parallel.float8_experts import resolve_grouped_mm
from llmtrain.parallel.topology import Topology
from llmtrain.parallel.watchdog import install_excepthook
from llmtrain.training.hf_io import (
    check_export,
    convert_model_dir,
    export,
    remove_import,
    with_model_tokenizer,
)
from llmtrain.training.memory_tracking import PeakMemory
from llmtrain.training.output_dir import Launch, commit, plan_launch
from llmtrain.training.trainer import LocalStepRunner, Trainer, TrainResult

T = TypeVar("T")


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical data order and replicated dropout streams (initial weights come
    from train.seed through llmtrain.models.init, not from these generators)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _deepspeed_parts(job: JobConfig, topo: Topology) -> tuple[torch.nn.Module, Any, LocalStepRunner]:
    """parallel.engine=deepspeed: the model wrapped whole by DeepSpeed's ZeRO engine, its optimizer
    adapter and the runner that drives the engine."""
    from llmtrain.models import build
    from llmtrain.parallel import apply_recompute
    from llmtrain.parallel.deepspeed_engine import build_deepspeed
    from llmtrain.parallel.deepspeed_engine import grad_sync as deepspeed_grad_sync

    # Built whole in fp32: DeepSpeed casts for bf16 and keeps the fp32 master in its optimizer.
    with torch.device(topo.device):
        model = build(job.model, job.train.seed)
    apply_recompute(model, job.model.recompute, job.model.recompute_layers)
    engine, optimizer = build_deepspeed(model, topo, job)
    runner = LocalStepRunner(engine, optimizer, job.train.micro_batch_size, deepspeed_grad_sync, topo.device)
    return engine.module, optimizer, runner


def _llmtrain_parts(job: JobConfig, topo: Topology) -> tuple[torch.nn.Module, Any, Any]:
    """parallel.engine=llmtrain: the model under TP/PP/DP, its ModelOptimizer and its step runner."""
    from llmtrain.models import empty_model
    from llmtrain.parallel import build_optimizer, grad_sync, parallelize
    from llmtrain.pipeline.executor import PipelineStepRunner, build_pipeline
    from llmtrain.planner.cost.flops import head_cost_in_layers

    # Built on meta, then each rank allocates and initialises only its own TP slice of its own stages
    # (parallelize, or build_pipeline with pp > 1). In fp32: parallelize casts to bf16/fp16 through its
    # buffers and keeps the exact fp32 master.
    with torch.device(topo.device):
        model = parallelize(empty_model(job.model, device="meta"), topo, job)
    if topo.pp > 1:
        head_cost = head_cost_in_layers(job.model) if job.parallel.balance_stages else 0.0
        model, executor = build_pipeline(model, topo, job, head_cost)
        optimizer = build_optimizer(model, topo, job)
        return model, optimizer, PipelineStepRunner(executor, optimizer, job.train.micro_batch_size)
    optimizer = build_optimizer(model, topo, job)
    runner = LocalStepRunner(
        model, optimizer, job.train.micro_batch_size, grad_sync, topo.device, loss_divisor(job, topo.dp)
    )
    return model, optimizer, runner


def loss_divisor(job: JobConfig, dp: int) -> float | None:
    """LocalStepRunner.loss_divisor: with train.dp_micro_batches, the global batch's micro-batches / dp
    (the reduction divides the replicas' sum by dp); None with equal shares."""
    t = job.train
    return t.global_batch_size / t.micro_batch_size / dp if t.dp_micro_batches else None


def build_trainer(
    job: JobConfig, topo: Topology, segment: int = 0, memory: PeakMemory | None = None
) -> Trainer:
    """Data, model, parallel layout, optimizer, metrics and checkpointer for `job`, assembled.

    Writes nothing to output_dir (metrics.jsonl opens at the first logged step); `segment` tags its rows;
    `memory` measures this rank's peaks (built under its tracking so the model's tensors count).
    """
    from llmtrain.checkpoint import Checkpointer
    from llmtrain.data import build_data
    from llmtrain.planner.cost.flops import model_flops_per_token
    from llmtrain.training.metrics import MetricsLogger

    seed_everything(job.train.seed)
    data = build_data(job, dp_rank=topo.dp_rank, dp_size=topo.dp)
    parts = _deepspeed_parts if job.parallel.engine == "deepspeed" else _llmtrain_parts
    model, optimizer, runner = parts(job, topo)
    if job.data.reset_attention_mask:  # packed documents end at the tokenizer's end-of-document token
        model.document_separator = data.tokenizer.eod_id
    metrics = MetricsLogger(
        job,
        is_main=topo.rank == 0,
        flops_per_token=model_flops_per_token(job.model, job.model.seq_length),
        world_size=topo.world_size,
        segment=segment,
    )
    return Trainer(
        job=job,
        topo=topo,
        runner=runner,
        optimizer=optimizer,
        data=data,
        metrics=metrics,
        checkpointer=Checkpointer(job, topo, tokenizer=data.tokenizer),
        model=model,
        tokens_per_sample=job.model.seq_length,
        memory=memory,
    )


def plan_layout(job: JobConfig, world_size: int) -> JobConfig:
    """With parallel.auto, the planner's best layout for this world size (re-planned on every launch,
    so an elastic restart on another number of workers gets a layout for that number)."""
    from llmtrain.planner import plan_for_world

    overrides, explanation = plan_for_world(job, world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"parallel.auto for {world_size} processes:\n{explanation}", flush=True)
    return with_overrides(job, overrides)


def on_rank0(topo: Topology, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 and give every rank its result, or raise its user error on every rank."""
    outcome: tuple[Any, UserError | None] = (None, None)
    if topo.rank == 0:
        try:
            outcome = (fn(), None)
        except UserError as err:
            outcome = (None, err)
    if topo.world_size > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    result, error = outcome
    if error is not None:
        raise error
    return result


def _commit(launch: Launch, job: JobConfig, world_size: int) -> None:
    try:
        commit(launch, job, world_size)
    except OSError as err:
        raise ConfigError(
            f"output_dir={launch.output_dir} cannot be written ({err.strerror}: {err.filename}); "
            "choose a writable output_dir"
        ) from err


def _restore(trainer: Trainer, launch: Launch, job: JobConfig, topo: Topology) -> None:
    """Load what the launch starts from; a model directory (checkpoint.load) is converted by rank 0 into a
    checkpoint of this layout first, which every rank loads and rank 0 then removes."""
    if not launch.model_dir:
        trainer.restore(launch.resume_from)
        return
    path = on_rank0(topo, lambda: convert_model_dir(job, launch.resume_from, topo.tp, topo.pp, topo.dp))
    try:
        trainer.restore(path)
        if dist.is_initialized():
            dist.barrier()  # every rank has read it
    finally:
        if topo.rank == 0:
            remove_import(job)
    trainer.checkpointer.last_good = None  # the conversion is gone: no checkpoint of this run exists yet


def _float8_note(job: JobConfig, device: torch.device) -> str:
    """Under fp8: the recipe, whether ZeRO-3 gathers the weights in float8, and (MoE) which grouped GEMM
    the routed experts run (train.fp8_grouped_mm as it resolves on this device)."""
    t = job.train
    if t.precision != "fp8":
        return ""
    notes = [f"recipe {t.fp8_recipe}"]
    if float8_all_gather(job):
        notes.append("ZeRO-3 weight all-gather in float8")
    if job.model.is_moe:
        mode = resolve_grouped_mm(t.fp8_grouped_mm, device, job.model)
        gemm = {"rowwise": "float8 rowwise", "mxfp8": "MXFP8", "bf16": "bf16 (the fallback)"}[mode]
        notes.append(f"routed experts' grouped GEMM in {gemm}, train.fp8_grouped_mm={t.fp8_grouped_mm}")
    return f" ({'; '.join(notes)})"


def startup_block(job: JobConfig, topo: Topology, launch: Launch) -> str:
    """What rank 0 prints before the first step: the model, layout, batch, precision, output and start."""
    import kernels
    from llmtrain.planner.cost.flops import num_parameters

    m, p, t, c = job.model, job.parallel, job.train, job.checkpoint
    accumulation = (
        "/".join(map(str, t.dp_micro_batches)) + " (per replica)"
        if t.dp_micro_batches
        else str(t.global_batch_size // (t.micro_batch_size * topo.dp))
    )
    pipeline = (
        f"pipeline schedule {p.schedule}, {p.virtual_stages} virtual stage(s) per rank" if topo.pp > 1 else ""
    )
    saves = [f"every {c.interval} steps"] if c.interval else []
    saves += [f"every {c.interval_minutes:g} min"] if c.interval_minutes else []
    saves += ["at the end and on SIGINT/SIGTERM"]
    kernel = kernels.resolve_impl(m.kernels, torch.empty(0, device=topo.device))
    rows = [
        (
            "model",
            f"{m.arch}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
            f"({m.kv_heads} kv), ffn {m.ffn_size}, vocab {m.vocab_size}; "
            f"{num_parameters(m) / 1e6:.2f}M parameters",
        ),
        (
            "layout",
            f"tp {topo.tp} x "
            + (f"cp {topo.cp} ({p.cp_comm}) x " if topo.cp > 1 else "")
            + f"pp {topo.pp} x dp {topo.dp} = {topo.world_size} "
            f"{'process' if topo.world_size == 1 else 'processes'}, "
            + (f"experts over ep {topo.ep} (of tp x cp x dp), " if topo.ep > 1 else "")
            + f"zero stage {p.zero_stage}"
            + (f", engine deepspeed (offload {p.offload})" if p.engine == "deepspeed" else "")
            + (f", {pipeline}" if pipeline else ""),
        ),
        (
            "batch",
            f"micro {t.micro_batch_size} x {accumulation} accumulation x dp {topo.dp} = global "
            f"{t.global_batch_size} samples x {m.seq_length} tokens = "
            f"{t.global_batch_size * m.seq_length:,} tokens per step",
        ),
        (
            "precision",
            f"{t.precision}{_float8_note(job, topo.device)}, kernels {kernel} (model.kernels={m.kernels})",
        ),
        (
            "output",
            f"{launch.output_dir} (segment {launch.segment}, config {os.path.basename(launch.config_file)}); "
            f"checkpoints {', '.join(saves)}, the last {c.keep} kept",
        ),
        ("start", f"{launch.start_text()}; training to step {t.steps}"),
    ]
    return "\n".join(f"{name:<10} {text}" for name, text in rows)


def run(job: JobConfig) -> TrainResult:
    """Train `job` on the processes torchrun (or a plain `python`) started."""
    from llmtrain.parallel import init_distributed

    if job.train.num_threads:
        torch.set_num_threads(job.train.num_threads)
    if job.parallel.auto:
        job = plan_layout(job, int(os.environ.get("WORLD_SIZE", "1")))
    check_export(job)
    topo = init_distributed(job)
    install_excepthook(topo.rank)
    topo.watchdog.start()
    trainer = None
    exit_code = 1  # what the W&B run is closed with if this launch fails
    try:
        launch = on_rank0(topo, lambda: plan_launch(job))
        if launch.nothing_to_do:
            return TrainResult(
                steps=launch.start_step,
                total_steps=job.train.steps,
                steps_run=0,
                final_loss=None,
                final_eval_loss=None,
                elapsed_s=0.0,
                skipped_steps=0,
                output_dir=job.output_dir,
                nothing_to_do=launch.nothing_to_do_text(),
            )
        if launch.model_dir:
            job = with_model_tokenizer(job, launch.resume_from)
        memory = PeakMemory(topo.device, job.logging.memory)
        with memory.tracking():
            trainer = build_trainer(job, topo, launch.segment, memory)
            _restore(trainer, launch, job, topo)
            memory.end_startup()
            on_rank0(topo, lambda: _commit(launch, job, topo.world_size))
            on_rank0(topo, trainer.metrics.start)
            if topo.rank == 0:
                print(startup_block(job, topo, launch), flush=True)
            result = trainer.fit()
            if job.checkpoint.export_hf and result.steps == job.train.steps and result.checkpoint:
                result.exported_hf = str(on_rank0(topo, lambda: export(job, result.checkpoint, result.steps)))
            exit_code = result.exit_code
            return result
    finally:
        topo.watchdog.stop()
        if trainer is not None:
            trainer.metrics.close(exit_code)
            trainer.checkpointer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
