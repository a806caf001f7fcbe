"""Helpers of the parallel tests: spawning a gloo process group and our stack's runs being compared."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

# Imported here so that the fork server, which preloads this module, holds it: a rank's first model built on
# meta imports it (torch._refs' normal_ goes through torch._compile), about 1.6 CPU-s per rank otherwise.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain import models
from llmtrain.config import JobConfig, ModelConfig
from llmtrain.parallel import (
    Topology,
    apply_cp,
    apply_ep,
    apply_float8,
    apply_recompute,
    apply_tp,
    build_optimizer,
    gather_full_state_dict,
    grad_sync,
    parallelize,
)
from llmtrain.parallel.optimizer import MakeOptimizer
from llmtrain.pipeline.executor import build_pipeline

ARCH_CONFIGS = {
    "gpt": dict(arch="gpt"),
    "llama": dict(arch="llama", num_kv_heads=2),  # GQA: kv heads split at tp=2, replicated at tp=4
    "ernie": dict(arch="ernie"),
    # Four experts, top-2. No load-balancing loss: the reference runs the global batch at once, our runs a
    # micro-batch at a time, and that loss is not a mean over tokens (its statistics are tested apart).
    "mixtral": dict(arch="mixtral", num_kv_heads=2, num_experts=4, router_aux_loss_coef=0.0),
    # Latent attention with a low-rank query, a dense first layer, then 4 routed experts and a shared one.
    "deepseek_v3": dict(
        arch="deepseek_v3", num_kv_heads=None, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, num_experts=4, moe_ffn_hidden_size=32, num_shared_experts=1,
        moe_layer_start=1, router_aux_loss_coef=0.0,
    ),
}  # fmt: skip


def tiny_job(arch: str, **overrides: Any) -> JobConfig:
    """2 layers, hidden 64, vocab 128, seq 16: the shapes every multi-process test uses."""
    job = JobConfig(
        model=ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=128,
            seq_length=16,
            kernels="torch",
            **ARCH_CONFIGS[arch],
        )
    )
    job.train.global_batch_size = 8
    job.train.micro_batch_size = 2
    job.train.grad_clip = 0.5  # below the gradient norms these runs see, so clipping is exercised
    # Adam divides by sqrt(v) + eps: a gradient that is ~0 up to fp32 rounding (1e-10, its sign set by the
    # summation order, which TP changes) moves a weight by up to lr * g / eps. The float64 bounds allow for
    # that (tests/parallel/_reference.py); eps=1e-6 keeps it, and so the bounds, small.
    job.train.adam_eps = 1e-6
    job.parallel.dp_bucket_mb = 0.02  # several buckets even for this tiny model
    for key, value in overrides.items():
        section = next(c for c in (job.model, job.train, job.parallel) if hasattr(c, key))
        setattr(section, key, value)
    return job


def batches(job: JobConfig, steps: int, seed: int = 99, learnable: bool = False) -> list[torch.Tensor]:
    """The global batches of a run: (global_batch, seq + 1) token ids, uniform noise or counting sequences."""
    g = torch.Generator().manual_seed(seed)
    shape = (job.train.global_batch_size, job.model.seq_length + 1)
    vocab = job.model.vocab_size
    if learnable:  # each row counts up from a random start: a model can drive the loss towards 0
        starts = torch.randint(0, vocab, (steps, shape[0], 1), generator=g)
        return list((starts + torch.arange(shape[1])) % vocab)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(steps)]


def parallel_run(
    job: JobConfig,
    topo: Topology,
    data: list[torch.Tensor],
    lr: float = 1e-3,
    make_optimizer: MakeOptimizer | None = None,
    held_out: torch.Tensor | None = None,
    trace: bool = False,
    through_executor: bool = False,
    setup: Callable[[torch.nn.Module], None] | None = None,
    resume: Callable[[Any, Any], None] | None = None,
) -> dict[str, Any]:
    """Our stack on ``topo`` over the global batches ``data``, assembled as training does: parallelize, and
    with pp > 1 (or ``through_executor``) this rank's pipeline stages run by the executor of
    ``job.parallel.schedule``; this DP rank's slice of each batch, accumulated over micro-batches. Returns
    the losses (mean over DP; then the loss of ``held_out`` after the last step), each step's StepStats and
    gradient norm, the full weights of every stage (gathered over TP and PP, on every rank), the model (its
    stages under the executor), the optimizer, the executor (None without one) and, with ``trace``, the
    executor's trace of the last step.
    ``setup`` is called with the model (stages) once it is built, before the first step; ``resume`` after it
    with the model (stages) and the optimizer, to load a checkpoint into them."""
    torch.manual_seed(job.train.seed)  # the default stream of replicated dropout, as the trainer seeds it
    # As the trainer builds it: on meta, each rank materialising only its part (parallelize/build_pipeline).
    model = models.empty_model(job.model, device="meta")
    pipelined = topo.pp > 1 or through_executor
    if pipelined:
        # parallelize without apply_dp, which build_optimizer installs on the stages.
        apply_tp(model, topo, job.parallel.sequence_parallel, job.train.seed)
        apply_ep(model, topo)
        apply_cp(model, topo, job.parallel.cp_comm)
        apply_float8(model, topo, job.train)
        apply_recompute(model, job.model.recompute, job.model.recompute_layers)
        model, executor = build_pipeline(model, topo, job)
    else:
        parallelize(model, topo, job)
    micro = job.train.micro_batch_size
    opt = build_optimizer(model, topo, job, make_optimizer)
    if setup is not None:
        setup(model)
    if resume is not None:
        resume(model, opt)

    def train_step(mine: torch.Tensor) -> float:
        if pipelined:
            scale = opt.loss_scale or 1.0
            return executor.run(list(mine.split(micro)), trace=trace, loss_scale=scale).item()
        total = 0.0
        micro_batches = mine.split(micro)
        for i, mb in enumerate(micro_batches):
            with grad_sync(model, i == len(micro_batches) - 1):
                loss = model(mb[:, :-1], mb[:, 1:]) / len(micro_batches)
                opt.backward(loss)
            total += loss.item()
        return total

    @torch.no_grad()
    def evaluate(mine: torch.Tensor) -> float:
        if pipelined:
            return executor.evaluate(list(mine.split(micro))).item()
        return torch.stack([model(mb[:, :-1], mb[:, 1:]) for mb in mine.split(micro)]).mean().item()

    def dp_mean(value: float) -> float:
        mean = torch.tensor([value / topo.dp], dtype=torch.float64)
        if topo.dp > 1:
            dist.all_reduce(mean, group=topo.dp_group)
        return mean.item()

    losses, stats, last_trace = [], [], None
    for batch in data:
        opt.zero_grad()
        losses.append(dp_mean(train_step(batch.chunk(topo.dp)[topo.dp_rank])))
        last_trace = executor.trace if pipelined else None
        stats.append(opt.step(lr))
    if held_out is not None:
        losses.append(dp_mean(evaluate(held_out.chunk(topo.dp)[topo.dp_rank])))
    state: dict[str, torch.Tensor] = {}
    for part in model.chunks if pipelined else [model]:
        state.update(gather_full_state_dict(part, topo))
    if topo.pp > 1:
        stages: list[Any] = [None] * topo.pp
        dist.all_gather_object(stages, state, group=topo.pp_group)
        state = {k: v for stage in stages for k, v in stage.items()}
    return {
        "losses": losses,
        "stats": stats,
        "grad_norms": [s.grad_norm for s in stats],
        "state": state,
        "model": model,
        "opt": opt,
        "trace": last_trace,
        "executor": executor if pipelined else None,
    }


def sgd(lr: float) -> MakeOptimizer:
    """Plain SGD over ModelOptimizer's groups: the update is lr times the gradient, so a gradient off by any
    factor shows in the weights (Adam would normalise it away)."""
    return lambda groups: torch.optim.SGD(groups, lr=lr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks fork from a server process that imported torch, DTensor and llmtrain's stack once (per test
# process), instead of each spawned rank importing them afresh: about 6 CPU-s per rank, the larger part of
# most multi-process tests. torchao's float8 too (about 2.5 CPU-s a rank of the FP8 tests; a missing module is
# skipped by the server).
mp.set_forkserver_preload(["torch", "torch.distributed.tensor", "torchao.float8", "tests.parallel._dist"])


def start_ranks(worker: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """mp.spawn(worker, args, nprocs) from the preloaded fork server, each rank in the test's environment.
    The arguments travel pickled by value: multiprocessing's own pickler would hand each tensor's storage
    over as a file descriptor, and the fork server takes at most 256 of them per process."""
    mp.start_processes(
        _in_test_environment,
        args=(dict(os.environ), pickle.dumps((worker, args))),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _in_test_environment(rank: int, env: dict[str, str], call: bytes) -> None:
    # A forked rank has the server's environment, from when it started: take the test's as it is now.
    os.environ.clear()
    os.environ.update(env)
    worker, args = pickle.loads(call)
    worker(rank, *args)


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A failing rank leaves the others waiting in a collective: fail within a minute, not gloo's 30.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
    except Exception:
        result = RuntimeError(f"rank {rank}:\n{traceback.format_exc()}")
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)
    if not isinstance(result, Exception):
        # Tear the group down together: a rank that leaves first closes its gloo connections while a peer
        # may still be finishing work on them (seen as SIGABRT, "terminate called without an active
        # exception"); gloo's barrier also waits for this rank's earlier work on the group.
        dist.barrier()
    dist.destroy_process_group()


def spawn(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo processes; return each rank's (picklable) result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        start_ranks(_worker, (world, free_port(), fn, args, out), world)
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _each_case(rank: int, world: int, fn: Callable[..., Any], cases: dict[str, tuple]) -> dict[str, Any]:
    return {name: fn(rank, world, *args) for name, args in cases.items()}


class SpawnedCases:
    """Results of fn(rank, world, *args) for named cases of (world, args): all cases of one world size run
    in turn in one gloo group, spawned at the first request for any of them (starting the processes and the
    group costs more than a small case). A case that fails fails every case of its group, raising the same
    error without spawning again. For a module-scoped fixture: called with a case's name, it returns each
    rank's result."""

    def __init__(self, fn: Callable[..., Any], cases: dict[str, tuple[int, tuple]]) -> None:
        self.fn, self.cases = fn, cases
        self.outcomes: dict[int, dict[str, list[Any]] | Exception] = {}

    def __call__(self, name: str) -> list[Any]:
        world = self.cases[name][0]
        if world not in self.outcomes:
            group = {n: args for n, (w, args) in self.cases.items() if w == world}
            try:
                by_rank = spawn(world, _each_case, self.fn, group)
            except Exception as err:
                self.outcomes[world] = err
                raise
            self.outcomes[world] = {n: [r[n] for r in by_rank] for n in group}
        outcome = self.outcomes[world]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome[name]


def call(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(rank, world, *args): as SpawnedCases's function, runs checks of different functions as cases of
    one process group (a case's args then start with its function)."""
    return fn(rank, world, *args)
