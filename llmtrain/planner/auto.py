"""`parallel.auto`: the layout the trainer uses for the current world size, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import JobConfig
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.layout import Layout, Software, parallel_overrides, sharding_overrides
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.report.choices import parallelism_notes
from llmtrain.planner.search.uniform import plan_job


def layout_overrides(layout: Layout) -> dict[str, Any]:
    """A layout as `key.path: value` config overrides (what tools/pretrain.py and config.load accept)."""
    return {
        "parallel.tp": layout.tp,
        "parallel.pp": layout.pp,
        "parallel.dp": layout.dp,
        "parallel.virtual_stages": layout.virtual_stages,
        "parallel.schedule": layout.schedule,
        "parallel.sequence_parallel": layout.sequence_parallel,
        "parallel.zero_stage": layout.zero_stage,
        "train.micro_batch_size": layout.micro_batch,
        "model.recompute": layout.recompute,
        **parallel_overrides(layout),
        **sharding_overrides(layout),
    }


def _describe(e: Estimate) -> str:
    return (
        f"{e.layout.short()}: {e.step_time:.3g} s/step, {e.tflops_per_gpu:.3g} TFLOP/s/GPU, "
        f"MFU {100 * e.mfu:.1f}%, "
        f"{e.memory_gb:.1f} of {e.capacity / 2**30:.0f} GiB"
    )


def run_software(job: JobConfig) -> Software:
    """The software a training run of `job` is on this machine: llmtrain, with the fused Triton kernels where
    model.kernels picks them (triton, or auto on CUDA), otherwise PyTorch's reference ops (CPU)."""
    fused = job.model.kernels == "triton"
    if job.model.kernels == "auto":
        import torch  # only here: the planner itself runs without torch

        fused = torch.cuda.is_available()
    return Software(fused_kernels=fused)


def plan_for_world(
    job: JobConfig, world_size: int, cluster: Cluster | str | Path | None = None
) -> tuple[dict[str, Any], str]:
    """Best layout for `world_size` processes: (config overrides, explanation). The cluster is the given one,
    else job.parallel.cluster, else a description of this machine (its GPU's preset or measured CPU)."""
    best, explanation = choose_layout(job, world_size, cluster)
    return layout_overrides(best.layout), explanation


def choose_layout(
    job: JobConfig, world_size: int, cluster: Cluster | str | Path | None = None
) -> tuple[Estimate, str]:
    """`parallel.auto`'s choice for `world_size` processes, as plan_for_world makes it: (its estimate, the
    explanation). The search prices the software the run uses (run_software)."""
    if cluster is None and job.parallel.cluster:
        try:
            cluster = load_cluster(job.parallel.cluster)
        except ConfigError as err:
            raise ConfigError(f"parallel.cluster: {err}") from None
    if cluster is None:
        from llmtrain.planner.calibration.profile import (
            local_cluster,  # torch only when describing this machine
        )

        cluster = local_cluster(world_size)
    elif not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    result = plan_job(job, cluster, world_size, software=run_software(job), top=5)
    fitting = result.fitting()
    if not fitting:
        raise ConfigError(
            f"parallel.auto: no layout of {job.model.num_layers} layers x {job.model.hidden_size} hidden "
            f"fits {world_size} x {result.cluster_name}; closest: {result.best.layout.short()} "
            f"({result.best.why}). "
            "Use more GPUs, a smaller train.global_batch_size or a smaller model"
        )
    best = fitting[0]
    lines = [f"parallel.auto chose {_describe(best)}"]
    lines.append(
        f"  breakdown: compute {best.compute:.3g} s, TP {best.tp_comm:.3g} s, "
        f"pipeline bubble {best.pp_bubble:.3g} s "
        f"({100 * best.bubble_fraction:.1f}%), DP exposed {best.dp_exposed:.3g} s, "
        f"optimizer {best.optimizer:.3g} s"
    )
    if len(fitting) > 1:
        second = fitting[1]
        lines.append(
            f"  runner-up ({100 * (second.step_time / best.step_time - 1):.1f}% slower): {_describe(second)}"
        )
    lines += [f"  {note}" for note in parallelism_notes(result)]
    lines.append(
        f"  {result.method} search over {result.evaluated} layouts in {result.seconds:.2f} s "
        f"on {result.cluster_name}"
    )
    return best, "\n".join(lines)
