"""ZeRO-2/3 and hybrid sharding through FSDP2 train like one process.

The reference is the one of test_equivalence.py: plain torch in float64 on one process, with the bounds an
fp32 run must stay within (tests/parallel/_reference.py: the gradient rounding u * sqrt(tokens * width)
carried through the updates, so a bound is met by torch's own fp32 run with the same margin). On top of
the bounds each fp32 layout's worst relative gap to the float64 run, over its losses and gradient norms,
must stay under 1e-4: fp32 rounds each operation to u = 6e-8 relative, and the reductions of these runs
(<= 2048 terms: 128 tokens of a step times a vocabulary of 128, or hidden/FFN 64/256) grow it to at most
u * sqrt(2048) ~ 3e-6 in the probabilistic analysis (u * 2048 ~ 1e-4 in the worst case, which no order of
summation reaches), so 1e-4 separates rounding from an error while a gradient off by a factor of dp (or a
missed micro-batch) moves the loss by > 1e-3 in three Adam steps and fails it.

Plain SGD (no clipping, no weight decay) shows a gradient wrongly scaled: the run whose FSDP gradient
divide factor is 1 instead of dp (sums instead of averages over DP) must fail the same bounds.

The zero-bubble pipeline (zb_h1) runs at zero 2 and 3: its W actions add the linear layers' weight gradients
after FSDP2's backward of their blocks. Besides matching one process, every rank's traced step shows those
gradients computed in W, deferred on the second pipeline rank, with the blocks' gathered weights freed.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from unittest import mock

import pytest
import torch
from torch import nn

from llmtrain.config import ConfigError, JobConfig, validate_world
from llmtrain.config.validate import validate
from llmtrain.parallel import Topology
from llmtrain.parallel.fsdp import fsdp_modules
from llmtrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from llmtrain.pipeline.split_backward import WeightGrad
from tests.parallel._dist import batches, parallel_run, sgd, spawn, tiny_job
from tests.parallel._reference import Reference, torch_reference

STEPS = 3
LR = 1e-3
SGD_LR = 1.0
WORST_RELATIVE_GAP = 1e-4
ZERO_BUBBLE = dict(pp=2, dp=2, num_layers=4, schedule="zb_h1")
ZERO_BUBBLE_TP = dict(zero_stage=3, tp=2, sequence_parallel=True, **ZERO_BUBBLE)
# (arch, overrides) on 4 processes, AdamW with clipping. Global batch 16 with micro-batches of 2 gives each
# DP rank 2 (dp=4) or 4 (dp=2) micro-batches: gradient accumulation, each micro-batch's gradients
# reduce-scattered into the shards, or (grad_reduce=step) accumulated unsharded until the last one's backward.
ADAMW_CASES = [
    ("gpt", dict(zero_stage=2, dp=4)),
    ("llama", dict(zero_stage=3, dp=4)),
    ("llama", dict(zero_stage=3, tp=2, dp=2, sequence_parallel=True)),
    ("ernie", dict(zero_stage=3, tp=2, dp=2, recompute="full")),
    # Tied embeddings (gpt) on the first and last stage: PipelineStages.sync_tied_grads over FSDP shards.
    ("gpt", dict(zero_stage=3, pp=2, dp=2, num_layers=4, virtual_stages=2, schedule="interleaved_1f1b")),
    ("gpt", dict(zero_stage=3, dp=4, dp_shard=2, grad_reduce="step")),
    # Zero-bubble: W computes the linear layers' weight gradients after FSDP2's backward of their block.
    ("llama", dict(zero_stage=2, **ZERO_BUBBLE)),
    # Tied embeddings on both end stages, biases, and I recomputing the forward.
    ("gpt", dict(zero_stage=3, recompute="full", grad_reduce="step", **ZERO_BUBBLE)),
    ("llama", dict(zero_stage=3, dp_shard=1, **ZERO_BUBBLE)),  # hybrid: the all-reduce across replicas
]
# bf16 against the bf16 one-process stack (flat buffers): both run the forward on the same bf16 roundings of
# the same fp32 masters, so the first loss is equal. They differ in the order fp32 gradients are summed
# (over micro-batches and ranks), which moves a master weight by ~1e-7 relative; that shows in bf16 only
# where a master crosses a rounding boundary and its bf16 copy moves by one ulp (2**-8), for a small
# fraction of the weights. Measured over 3 steps: 1.1e-5; 1e-3 allows ~100 times as many flips.
BF16_TOLERANCE = 1e-3
# Zero-bubble in bf16: W's bf16 weight gradients are summed in FSDP's fp32 accumulators, as 1F1B's are.
BF16_CASES = [dict(zero_stage=3, dp=4), dict(zero_stage=3, **ZERO_BUBBLE)]


_REFERENCES: dict[str, Reference] = {}


def _reference(job: JobConfig) -> Reference:
    """torch_reference of `job` at LR, computed once per module for every layout whose job differs only in
    the layout: the float64 run reads the model and training settings (recompute, which changes no value,
    aside), and of the 10 AdamW layouts here 5 share a model with another (the tp, hybrid and zero-bubble
    variants), each float64 run with its Hessian-vector products costing a few CPU-s."""
    model = replace(job.model, recompute="none", recompute_layers=[])
    key = repr((model, job.train))
    if key not in _REFERENCES:
        _REFERENCES[key] = torch_reference(job, batches(job, STEPS), LR)
    return _REFERENCES[key]


def _job(arch: str, overrides: dict) -> JobConfig:
    job = tiny_job(arch, **overrides)
    job.train.global_batch_size = 16
    return job


def _shard_facts(model: torch.nn.Module) -> dict:
    """The DP mesh's shape and, for one weight, the local shard's rows against the full tensor's."""
    weight = next(p for p in model.parameters() if p.ndim == 2)
    return {
        "mesh": tuple(weight.device_mesh.shape),
        "local_rows": weight.to_local().shape[0],
        "rows": weight.shape[0],
    }


def _divide_by_one(model: torch.nn.Module) -> None:
    """The deliberate error of the SGD check: gradients summed over DP instead of averaged."""
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        module.set_gradient_divide_factor(1.0)


class WeightGradWork:
    """Every weight gradient the zero-bubble executor computes from its deferred work (WeightGrad): when,
    and whether the layer's gathered (unsharded) weight was freed by then, as FSDP2 frees it on
    resharding. Patches WeightGrad.compute while entered."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.freed: list[bool] = []
        original = WeightGrad.compute

        def compute(work: WeightGrad) -> list:
            self.times.append(time.perf_counter())
            self.freed.append(work.weight.untyped_storage().nbytes() == 0)
            return original(work)

        self._patch = mock.patch.object(WeightGrad, "compute", compute)

    def __enter__(self) -> WeightGradWork:
        self._patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.stop()

    def facts(self, run: dict) -> dict:
        """The traced last step's compute actions, the (kind, micro-batch) of the action each of its weight
        gradients was computed in, how many were computed outside any action, whether each found its
        weight freed, and the number of linear layers on this rank."""
        trace = run["trace"]
        last_step = [i for i, t in enumerate(self.times) if t >= trace[0]["start"]]
        computed = [
            (e["kind"], e["microbatch"])
            for i in last_step
            for e in trace
            if e["start"] <= self.times[i] <= e["end"]
        ]
        linears = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
        return {
            "pp_rank": trace[0]["rank"],
            "computes": [(e["kind"], e["microbatch"]) for e in trace],
            "weight_grads": computed,
            "outside": len(last_step) - len(computed),
            "freed": [self.freed[i] for i in last_step],
            "linears": sum(isinstance(m, linears) for m in run["model"].modules()),
        }


def _worker(rank: int, world: int) -> dict:
    out: dict = {"adamw": [], "sgd": [], "bf16": []}
    for arch, overrides in ADAMW_CASES:
        job = _job(arch, overrides)
        zero_bubble = job.parallel.schedule == "zb_h1"
        with WeightGradWork() as work:
            run = parallel_run(
                job, Topology(job.parallel, world, rank), batches(job, STEPS), LR, trace=zero_bubble
            )
        facts = _shard_facts(run["model"]) | (work.facts(run) if zero_bubble else {})
        out["adamw"].append({k: run[k] for k in ("losses", "grad_norms", "state")} | facts)
    for wrong in (False, True):
        job = _job("llama", dict(zero_stage=3, dp=4))
        job.train.grad_clip = job.train.weight_decay = 0.0
        setup = _divide_by_one if wrong else None
        topo = Topology(job.parallel, world, rank)
        run = parallel_run(job, topo, batches(job, STEPS), SGD_LR, sgd(SGD_LR), setup=setup)
        out["sgd"].append({k: run[k] for k in ("losses", "grad_norms", "state")})
    for overrides in BF16_CASES:
        job = _job("llama", dict(precision="bf16", **overrides))
        data = batches(job, STEPS)
        run = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
        single = None
        if rank == 0:
            layers = job.model.num_layers
            single = parallel_run(
                _job("llama", dict(precision="bf16", num_layers=layers)), Topology.single(), data, LR
            )
        out["bf16"].append(
            {
                "fsdp": run["losses"] + run["grad_norms"],
                "single": single["losses"] + single["grad_norms"] if single else None,
                "param_dtype": next(run["model"].parameters()).dtype,
            }
        )
    return out


@functools.cache
def _results() -> list[dict]:
    return spawn(4, _worker)


def _worst_gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


@pytest.mark.slow
def test_fsdp_layouts_match_single_process() -> None:
    failures = []
    for (arch, overrides), run in zip(ADAMW_CASES, _results()[0]["adamw"], strict=True):
        job = _job(arch, overrides)
        reference = _reference(job)
        name = f"AdamW {arch} {overrides}"
        failures += reference.check(name, run["losses"], run["grad_norms"], run["state"])
        gap = _worst_gap(run["losses"] + run["grad_norms"], reference.losses + reference.grad_norms)
        print(f"{name}: worst relative gap to float64 {gap:.2e}")  # shown with pytest -s
        if not gap <= WORST_RELATIVE_GAP:
            failures.append(f"{name}: worst relative gap {gap:.2e}")
        dp, shard = job.parallel.dp, job.parallel.dp_shard or job.parallel.dp
        expected_mesh = (shard,) if shard == dp else (dp // shard, shard)
        if run["mesh"] != expected_mesh or run["local_rows"] != -(-run["rows"] // shard):
            failures.append(f"{name}: mesh {run['mesh']}, {run['local_rows']} of {run['rows']} rows local")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_fsdp_gradient_has_the_single_process_scale() -> None:
    job = _job("llama", dict(zero_stage=3, dp=4))
    job.train.grad_clip = job.train.weight_decay = 0.0
    reference = torch_reference(job, batches(job, STEPS), SGD_LR, sgd=True)
    right, wrong = (
        reference.check("SGD", r["losses"], r["grad_norms"], r["state"]) for r in _results()[0]["sgd"]
    )
    assert not right, "\n".join(right)
    assert wrong, "gradients summed over DP instead of averaged passed the bounds"


@pytest.mark.slow
def test_fsdp_bf16_matches_bf16_single_process() -> None:
    for overrides, bf16 in zip(BF16_CASES, _results()[0]["bf16"], strict=True):
        assert bf16["param_dtype"] == torch.float32  # the sharded parameters are the fp32 masters
        gap = _worst_gap(bf16["fsdp"], bf16["single"])
        print(f"bf16 {overrides}: worst relative gap to bf16 one process {gap:.2e}")
        assert gap <= BF16_TOLERANCE, f"bf16 {overrides} against one process: worst relative gap {gap:.2e}"


def check_zero_bubble(name: str, facts: dict, microbatches: int) -> None:
    """The weight gradients of every linear layer (the output layer too) came from the W actions, W(i) after
    I(i) and, on pipeline rank 1, deferred past later actions; the layer's gathered weight was freed by then
    (FSDP2 resharded its block after I: W never gathers parameters)."""
    want = [("W", mb) for mb in range(microbatches) for _ in range(facts["linears"])]
    assert facts["linears"] and facts["weight_grads"] == want and not facts["outside"], (name, facts)
    assert all(facts["freed"]), (name, facts["freed"])
    computes = facts["computes"]
    delays = [computes.index(("W", mb)) - computes.index(("I", mb)) for mb in range(microbatches)]
    assert min(delays) >= 1, (name, computes)
    assert max(delays) > 1 if facts["pp_rank"] == 1 else delays == [1] * microbatches, (name, computes)


@pytest.mark.slow
def test_zero_bubble_defers_weight_gradients_under_fsdp() -> None:
    """zb_h1 with ZeRO-2/3 (matching one process: test_fsdp_layouts_match_single_process) keeps its deferred
    W actions: on both pipeline ranks of every data-parallel replica."""
    for i, (arch, overrides) in enumerate(ADAMW_CASES):
        if overrides.get("schedule") != "zb_h1":
            continue
        job = _job(arch, overrides)
        microbatches = job.train.global_batch_size // (job.train.micro_batch_size * job.parallel.dp)
        for rank, results in enumerate(_results()):
            check_zero_bubble(f"{arch} {overrides} rank {rank}", results["adamw"][i], microbatches)


def _zero_bubble_under_tp(rank: int, world: int) -> dict:
    job = _job("llama", ZERO_BUBBLE_TP)
    with WeightGradWork() as work:
        run = parallel_run(job, Topology(job.parallel, world, rank), batches(job, STEPS), LR, trace=True)
    return {k: run[k] for k in ("losses", "grad_norms", "state")} | work.facts(run)


@pytest.mark.slow
def test_zero_bubble_fsdp_under_tensor_parallelism() -> None:
    """zb_h1 with ZeRO-3 over tp=2 (sequence parallel), pp=2, dp=2 on 8 processes: one process's losses and
    gradient norms, and the column/row parallel layers' weight gradients computed in W."""
    job = _job("llama", ZERO_BUBBLE_TP)
    reference = _reference(job)
    results = spawn(8, _zero_bubble_under_tp)
    run = results[0]
    failures = reference.check("zb_h1 zero3 tp2", run["losses"], run["grad_norms"], run["state"])
    assert not failures, "\n".join(failures)
    gap = _worst_gap(run["losses"] + run["grad_norms"], reference.losses + reference.grad_norms)
    print(f"zb_h1 zero3 tp=2 pp=2 dp=2: worst relative gap to float64 {gap:.2e}")
    assert gap <= WORST_RELATIVE_GAP, f"worst relative gap {gap:.2e}"
    for rank, facts in enumerate(results):
        check_zero_bubble(
            f"tp rank {rank}", facts, job.train.global_batch_size // (job.train.micro_batch_size * 2)
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(zero_stage=4), "parallel.zero_stage must be 0, 1, 2 or 3"),
        (dict(zero_stage=1, dp_shard=2), "needs parallel.zero_stage 2 or 3"),
        (dict(zero_stage=3, dp_shard=0), "parallel.dp_shard must be at least 1"),
        (dict(zero_stage=1, grad_reduce="step"), "parallel.grad_reduce=step chooses how FSDP2"),
    ],
)
def test_unsupported_zero_layouts_are_rejected(overrides: dict, message: str) -> None:
    job = JobConfig()
    for key, value in overrides.items():
        setattr(job.parallel, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(job)


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1"])
def test_sharded_data_parallelism_runs_every_pipeline_schedule(zero_stage: int, schedule: str) -> None:
    job = JobConfig()
    job.parallel.zero_stage, job.parallel.pp, job.parallel.schedule = zero_stage, 2, schedule
    job.parallel.virtual_stages = 2 if schedule == "interleaved_1f1b" else 1
    validate(job)


def test_dp_shard_must_divide_dp() -> None:
    job = JobConfig()
    job.parallel.zero_stage, job.parallel.dp_shard = 3, 3
    job.train.global_batch_size, job.train.micro_batch_size = 16, 1
    with pytest.raises(ConfigError, match="parallel.dp_shard=3 does not divide the data-parallel degree 4"):
        validate_world(job, 4)
