"""The pipeline executor over gloo against the single-process run (the reference: plain gradient
accumulation on one process with the same optimizer), fp32: the loss of every optimizer step within 1e-5
relative and the final weights within 1e-5 absolute, for every schedule, with TP and DP where given."""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from llmtrain.models import build
from llmtrain.parallel import Topology, apply_tp, build_optimizer, gather_full_state_dict, grad_sync
from llmtrain.pipeline.executor import PipelineStepRunner, build_pipeline
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.stages import partition_layers
from llmtrain.planner.flops import head_cost_in_layers
from llmtrain.training.profiling import StepTimer

STEPS = 3
MICRO = 2  # samples per micro-batch


def make_job(
    arch: str,
    layers: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    schedule: str = "1f1b",
    v: int = 1,
    sp: bool = False,
    zero: int = 0,
) -> JobConfig:
    model = ModelConfig(
        arch=arch, num_layers=layers, hidden_size=32, num_attention_heads=4, num_kv_heads=2, vocab_size=64,
        seq_length=8, ffn_hidden_size=64, kernels="torch",
    )  # fmt: skip
    parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, schedule=schedule, virtual_stages=v, sequence_parallel=sp)
    if zero:
        # Sharded optimizer over several small buckets, so shards split parameters.
        parallel.zero_stage, parallel.dp_bucket_mb = zero, 0.004
    # adam_eps 1e-4: Adam moves an element by ~lr whatever its gradient's size, so one whose true gradient is
    # ~0 (gpt's key bias: softmax ignores it; rarely hit embedding rows) moves by lr * round-off / eps.
    train = TrainConfig(
        lr=1e-2, warmup_steps=0, micro_batch_size=MICRO, global_batch_size=8, grad_clip=1.0, adam_eps=1e-4
    )
    return JobConfig(model=model, parallel=parallel, train=train)


def data(job: JobConfig, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(
        0, job.model.vocab_size, (job.train.global_batch_size, job.model.seq_length + 1), generator=g
    )


def reference(job: JobConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: accumulate over all micro-batches of the global batch, then the optimizer step; returns
    the loss of every step plus the held-out loss after the last, and the final weights."""
    torch.manual_seed(job.train.seed)
    model = build(job.model)
    opt = build_optimizer(model, Topology.single(), job)
    losses = []
    for step in range(STEPS):
        micro = data(job, step).split(MICRO)
        total = 0.0
        for i, mb in enumerate(micro):
            with grad_sync(model, enabled=i == len(micro) - 1):
                loss = model(mb[:, :-1], labels=mb[:, 1:])
                opt.backward(loss / len(micro))
            total += loss.item()
        opt.step(job.train.lr)
        opt.zero_grad()
        losses.append(total / len(micro))
    with torch.no_grad():
        held_out = data(job, STEPS)
        losses.append(
            torch.stack([model(mb[:, :-1], labels=mb[:, 1:]) for mb in held_out.split(MICRO)]).mean().item()
        )
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipelined(job: JobConfig, topo: Topology, trace: bool = False) -> tuple:
    """The same run with this rank's pipeline chunks: (losses as in reference(), full weights of its
    chunks[, the last step's trace])."""
    torch.manual_seed(job.train.seed)
    model = build(job.model)
    apply_tp(model, topo, job.parallel.sequence_parallel, job.train.seed)
    stages, executor = build_pipeline(model, topo, job)
    del model
    opt = build_optimizer(stages, topo, job)
    runner = PipelineStepRunner(executor, opt, MICRO)
    losses = []

    def dp_mean(loss: torch.Tensor) -> float:
        if topo.dp > 1:
            dist.all_reduce(loss, group=topo.dp_group)
            loss /= topo.dp
        return loss.item()

    for step in range(STEPS):
        local = data(job, step).chunk(topo.dp)[topo.dp_rank]
        if trace:
            loss = executor.run(list(local.split(MICRO)), trace=trace)
        else:
            loss = runner.train_step(local, StepTimer(enabled=False))
        losses.append(dp_mean(loss))
        last_trace = executor.trace
        opt.step(job.train.lr)
        opt.zero_grad()
    # The held-out loss of the trained model, forwards only (the last entry, as in reference()).
    losses.append(dp_mean(runner.eval_step(data(job, STEPS).chunk(topo.dp)[topo.dp_rank])))
    weights: dict[str, torch.Tensor] = {}
    for chunk in stages.chunks:
        weights.update(gather_full_state_dict(chunk, topo))
    return (losses, weights, last_trace) if trace else (losses, weights)


def _worker(rank: int, world: int, store: str, cases: list, refs: list, results: dict) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        for args, (ref_losses, ref_weights) in zip(cases, refs, strict=True):
            job = make_job(*args)
            topo = Topology(job.parallel, world, rank)
            losses, weights = pipelined(job, topo)
            case = f"{args} rank {rank}"
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref_losses),
                rtol=1e-5,
                atol=0,
                msg=lambda m, c=case: f"{c}\n{m}",
            )
            for name, w in weights.items():
                torch.testing.assert_close(
                    w, ref_weights[name], rtol=0, atol=1e-5, msg=lambda m, n=name, c=case: f"{c}: {n}\n{m}"
                )
            dist.barrier()
        results[rank] = "ok"
    except Exception:
        results[rank] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, cases: list) -> None:
    # The single-process references run here once, not on every rank; one thread, as the workers.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = [reference(make_job(*case)) for case in cases]
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        store = os.path.join(tmp, "store")
        mp.spawn(_worker, args=(world, store, cases, refs, results), nprocs=world, join=True)
        failures = {r: results.get(r, "no result") for r in range(world) if results.get(r) != "ok"}
        assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


SCHEDULES_V = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


ARCHS = ("gpt", "llama", "ernie")
# (tp, pp, dp) layouts by world size: issue 4's acceptance matrix.
LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 4, 1), (2, 2, 1), (1, 2, 2)], 8: [(2, 2, 2)]}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_arch_layout_and_schedule_matches_one_process(world):
    # gpt: biases (deferred in W), learned positions, tied embeddings (a copy on each end stage);
    # llama: untied head, grouped-query attention; ernie: tied, interleaved rotary. Two layers per chunk of
    # the interleaved schedule's largest split. Sequence parallelism rides along with zero-bubble under TP.
    cases = [
        (arch, 4 * pp // 2, tp, pp, dp, schedule, v)
        for tp, pp, dp in LAYOUTS[world]
        for arch in ARCHS
        for schedule, v in SCHEDULES_V
    ]
    cases += [
        (arch, 4, tp, pp, dp, "zb_h1", 1, True) for tp, pp, dp in LAYOUTS[world] if tp > 1 for arch in ARCHS
    ]
    # ZeRO-1 under the pipeline: the tied embedding's two copies (gpt, ernie) are summed shard by shard.
    cases += [
        (arch, 4, tp, pp, dp, schedule, v, False, 1)
        for tp, pp, dp in LAYOUTS[world]
        if dp > 1
        for arch in ("gpt", "ernie")
        for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2))
    ]
    run_world(world, cases)


@pytest.mark.slow
def test_pp1_is_the_degenerate_case_of_the_same_executor():
    job = make_job("ernie", 2)
    ref_losses, ref_weights = reference(job)
    for name in ("1f1b", "zb_h1"):
        job.parallel.schedule = name
        losses, weights, trace = pipelined(job, Topology.single(), trace=True)
        # The trace holds every compute action of the schedule; zero-bubble W really computes weight grads.
        kinds = [e["kind"] for e in trace]
        assert kinds == [a.kind for a in build_schedule(name, 1, 4).compute(0)]
        if name == "zb_h1":
            assert min(e["end"] - e["start"] for e in trace if e["kind"] == "W") > 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for key, w in weights.items():
            torch.testing.assert_close(w, ref_weights[key], rtol=0, atol=1e-5, msg=key)


def test_partition_layers_even_and_balanced():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    # A head as heavy as two layers leaves the last stage fewer layers.
    heavy_head = partition_layers(8, 4, head_cost=2.0)
    assert len(heavy_head[-1]) == 1 and max(len(r) for r in heavy_head) == 3
    # Brute force over all cuts: the partition minimises the most expensive stage.
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    got = partition_layers(8, 3, costs)
    best = min(
        max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:])) for a in range(1, 7) for b in range(a + 1, 8)
    )
    assert max(sum(costs[r.start : r.stop]) for r in got) == best
    with pytest.raises(ValueError, match="model.num_layers=2"):
        partition_layers(2, 3)


def test_training_balances_stages_by_flops():
    # The benchmark's llama 8 x 256, vocab 4096, seq 64: the head (2hV = 2.10 MFLOP/token) outweighs a
    # layer (q, k, v, o 0.52 + MLP 1.05 + attention 0.07 = 1.64 MFLOP/token), so the last stage of two
    # gives one layer up.
    model = ModelConfig(arch="llama", num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=4096,
                        seq_length=64, ffn_hidden_size=683)  # fmt: skip
    cost = head_cost_in_layers(model)
    assert cost == pytest.approx(2 * 256 * 4096 / (8 * 256 * 256 + 6 * 256 * 683 + 4 * 64 * 256))
    assert [len(r) for r in partition_layers(8, 2, head_cost=cost)] == [5, 3]
    assert [len(r) for r in partition_layers(8, 2)] == [4, 4]
