"""The pipeline executor over gloo against one process. The reference: plain torch in float64 on the whole
global batch (AdamW, clipping), with the bounds an fp32 run must stay within (tests/parallel/_reference.py):
every step's loss and the held-out loss after the last, every step's gradient norm and the final weights of
every stage, for every schedule, with TP, SP, DP and ZeRO-1 where given."""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmtrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from llmtrain.parallel import Topology
from llmtrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.pipeline.stages import partition_layers
from llmtrain.planner.cost.flops import head_cost_in_layers
from tests.parallel._dist import parallel_run, start_ranks
from tests.parallel._reference import Reference, torch_reference

STEPS = 2
"""Steps of each run: the first from a fresh optimizer, the second with the Adam moments (and ZeRO-1 shards)
the first left, the held-out loss then checking the weights after both; a third step runs the same code again.
Each of the ~80 cases costs per step, so 2 rather than 3 takes a third off these tests."""
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
    stage_layers: tuple[int, ...] = (),
    recompute_layers: tuple[str, ...] = (),
    micro: int = MICRO,
    batch: int = 8,
) -> JobConfig:
    model = ModelConfig(
        arch=arch, num_layers=layers, hidden_size=32, num_attention_heads=4, num_kv_heads=2, vocab_size=64,
        seq_length=8, ffn_hidden_size=64, kernels="torch",
    )  # fmt: skip
    model.recompute_layers = list(recompute_layers)
    parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, schedule=schedule, virtual_stages=v, sequence_parallel=sp)
    parallel.stage_layers = list(stage_layers)
    if zero:
        # Sharded optimizer over several small buckets, so shards split parameters.
        parallel.zero_stage, parallel.dp_bucket_mb = zero, 0.004
    # adam_eps 1e-4: Adam moves an element by ~lr whatever its gradient's size, so one whose true gradient is
    # ~0 (gpt's key bias: softmax ignores it; rarely hit embedding rows) moves by lr * round-off / eps; the
    # float64 bounds allow for it, and eps 1e-4 keeps it (and them) small. lr 1e-3 (Adam moves every weight
    # by ~3e-3 over the run): the weight errors of one step perturb the next step's gradients in proportion
    # to lr^2, against lr for the rounding the bounds cover; at 1e-2 the former overtook the latter by
    # step 3 in the 8-layer model (gradient error 8e-5 against 5e-6 relative, torch's own fp32 run too).
    train = TrainConfig(
        lr=1e-3, warmup_steps=0, micro_batch_size=micro, global_batch_size=batch, grad_clip=1.0, adam_eps=1e-4
    )
    return JobConfig(model=model, parallel=parallel, train=train)


def data(job: JobConfig, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(
        0, job.model.vocab_size, (job.train.global_batch_size, job.model.seq_length + 1), generator=g
    )


def run(job: JobConfig, topo: Topology, trace: bool = False, setup: Any = None) -> dict:
    """Our run of the job's schedule, always through the executor (also at pp=1): the losses of every step
    and the held-out loss after the last, as reference() has them."""
    steps = [data(job, step) for step in range(STEPS)]
    return parallel_run(
        job,
        topo,
        steps,
        job.train.lr,
        held_out=data(job, STEPS),
        trace=trace,
        through_executor=True,
        setup=setup,
    )


@functools.cache
def reference(arch: str, layers: int, batch: int = 8) -> Reference:
    """The float64 run (it does not depend on the layout), with the held-out loss after the last step."""
    job = make_job(arch, layers, batch=batch)
    return torch_reference(
        job, [data(job, step) for step in range(STEPS)], job.train.lr, held_out=data(job, STEPS)
    )


def check(case: str, job: JobConfig, result: dict) -> None:
    failures = reference(job.model.arch, job.model.num_layers, job.train.global_batch_size).check(
        case, result["losses"], result["grad_norms"], result["state"]
    )
    assert not failures, "\n".join(failures)


def _worker(rank: int, world: int, store: str, cases: list, refs: list, out: str) -> None:
    """Runs the cases in turn; records in the file `out`.<rank> per case the failures of its checks on this
    rank (an empty list: it passed), or the traceback of an error, which ends the run."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        failures, traced = {}, {}
        for args, ref in zip(cases, refs, strict=True):
            job = make_job(*args)
            arrivals = GradientArrivals() if _traced_under_tp(job) else None
            result = run(
                job, Topology(job.parallel, world, rank), arrivals is not None, arrivals and arrivals.watch
            )
            if arrivals is not None:
                traced[args] = {"trace": result["trace"], "arrivals": arrivals.kinds(result["trace"])}
            failures[args] = ref.check(
                f"{args} rank {rank}", result["losses"], result["grad_norms"], result["state"]
            )
            if job.parallel.stage_layers:  # this rank's chunks hold the layers the config gives them
                held = [sorted(map(int, chunk.layers)) for chunk in result["model"].chunks]
                sizes, pp = job.parallel.stage_layers, job.parallel.pp
                starts = [sum(sizes[:c]) for c in range(len(sizes))]
                mine = range(rank % pp, len(sizes), pp)  # tp=dp=1 in these cases
                if held != [list(range(starts[c], starts[c] + sizes[c])) for c in mine]:
                    failures[args].append(f"{args} rank {rank}: stages hold layers {held}")
            dist.barrier()
        failures[ZERO_BUBBLE_TP] = traced
        outcome: dict | str = failures
    except Exception:
        outcome = traceback.format_exc()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(outcome, f)
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def _world_results(world: int) -> dict[int, dict | str]:
    """Every case of this module at `world` processes (WORLD_CASES), run in one gloo group: starting the
    processes and the group costs more than a case. Each rank's per-case failures, or its error."""
    cases = WORLD_CASES[world]
    refs = [reference(case[0], case[1], make_job(*case).train.global_batch_size) for case in cases]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        start_ranks(_worker, (world, os.path.join(tmp, "store"), cases, refs, out), world)
        results = {}
        for r in range(world):
            try:
                with open(f"{out}.{r}", "rb") as f:
                    results[r] = pickle.load(f)
            except FileNotFoundError:
                results[r] = "no result"
        return results


def run_world(world: int, cases: list) -> None:
    """The cases (each in WORLD_CASES[world]) matched one process on every rank."""
    results = _world_results(world)
    errors = {r: msg for r, msg in results.items() if isinstance(msg, str)}
    assert not errors, "\n".join(f"rank {r}:\n{msg}" for r, msg in errors.items())
    failures = [f for case in cases for r in range(world) for f in results[r][case]]
    assert not failures, "\n".join(failures)


SCHEDULES_V = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


ARCHS = ("gpt", "llama", "ernie")
# (tp, pp, dp) layouts by world size: issue 4's acceptance matrix.
LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 4, 1), (2, 2, 1), (1, 2, 2)], 8: [(2, 2, 2)]}
ORDER = [layout for world in sorted(LAYOUTS) for layout in LAYOUTS[world]]


def arch_of(layout: tuple[int, int, int], schedule: int) -> str:
    """The architecture of one cell of the layout x schedule matrix: ARCHS[(i + j) % 3] for the layout's
    index i in ORDER and the schedule's j in SCHEDULES_V. Every layout meets every schedule, and each of
    both meets every architecture (a layout runs 4 schedules, so all 3 archs; a schedule runs on 5
    layouts, so all 3 archs): every pair of the three factors, 20 runs instead of the 60 of their product,
    which took 8 gloo processes on 2 cores several minutes. An architecture reaches the executor only
    through which stage owns what (the tied embedding's copies, biases deferred to W, GQA under TP), and a
    schedule only through its order of actions, which no architecture changes."""
    return ARCHS[(ORDER.index(layout) + schedule) % len(ARCHS)]


def arch_layout_cases(world: int) -> list[tuple]:
    # gpt: biases (deferred in W), learned positions, tied embeddings (a copy on each end stage);
    # llama: untied head, grouped-query attention; ernie: tied, interleaved rotary. Two layers per chunk of
    # the interleaved schedule's largest split. Sequence parallelism rides along with zero-bubble under TP.
    cases = [
        (arch_of((tp, pp, dp), j), 4 * pp // 2, tp, pp, dp, schedule, v)
        for tp, pp, dp in LAYOUTS[world]
        for j, (schedule, v) in enumerate(SCHEDULES_V)
    ]
    # Every architecture at the TP-only layout (each brings its own layers to the split sequence: biases,
    # learned positions, rotary), the next cell's architecture at tp x dp.
    cases += [
        (arch, 4, tp, pp, dp, "zb_h1", 1, True)
        for tp, pp, dp in LAYOUTS[world]
        if tp > 1
        for arch in (ARCHS if dp == 1 else [arch_of((tp, pp, dp), len(SCHEDULES_V))])
    ]
    # ZeRO-1 under the pipeline: the tied embedding's two copies (gpt, ernie) are summed shard by shard;
    # both tied architectures and both schedules at each DP layout, in crossed pairs.
    cases += [
        (arch, 4, tp, pp, dp, schedule, v, False, 1)
        for tp, pp, dp in LAYOUTS[world]
        if dp > 1
        for arch, (schedule, v) in zip(
            ("gpt", "ernie") if tp == 1 else ("ernie", "gpt"),
            (("1f1b", 1), ("interleaved_1f1b", 2)),
            strict=True,
        )
    ]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_arch_layout_and_schedule_matches_one_process(world):
    run_world(world, arch_layout_cases(world))


# The V-shaped and interleaved zero-bubble schedules (issue 35), as few cases as cover each feature, at most
# four processes: (arch, layers, tp, pp, dp, schedule, v, sp, zero, stage_layers, recompute_layers, micro,
# batch). gpt's tied embedding sits at both ends of the V on rank 0 (one parameter there).
FULL_SELECTIVE = ("full", "selective", "none", "full")
V_CASES = {
    2: [
        ("gpt", 4, 1, 2, 1, "zb_v", 2),
        ("llama", 4, 1, 2, 1, "dualpipe_v", 2, False, 0, (), FULL_SELECTIVE),  # recompute full / selective
        ("ernie", 4, 1, 2, 1, "interleaved_zb", 2, False, 0, (), ("selective",) * 4),
        ("gpt", 4, 1, 2, 1, "dualpipe_v", 2, False, 0, (), (), 1, 5),  # an odd count: 5 micro-batches
        ("llama", 4, 1, 2, 1, "zb_v", 2, False, 0, (), (), 1, 1),  # fewer micro-batches (1) than ranks
    ],
    4: [
        ("gpt", 8, 1, 4, 1, "zb_v", 2, False, 0, (), (), 1),  # pp=4, 8 micro-batches
        ("llama", 8, 1, 4, 1, "dualpipe_v", 2, False, 0, (), (), 1),
        ("ernie", 8, 1, 4, 1, "interleaved_zb", 2, False, 0, (), (), 1, 5),  # pp=4, odd: 5
        ("ernie", 8, 1, 4, 1, "zb_v", 2, False, 0, (), (), 1, 3),  # pp=4, 3 micro-batches
        ("gpt", 4, 2, 2, 1, "zb_v", 2, True),  # tp=2 + sequence parallelism
        ("llama", 4, 2, 2, 1, "dualpipe_v", 2, True),
        ("ernie", 4, 2, 2, 1, "interleaved_zb", 2, True),
        ("gpt", 4, 1, 2, 2, "dualpipe_v", 2, False, 1, (), (), 1),  # dp=2, ZeRO-1
        ("ernie", 4, 1, 2, 2, "zb_v", 2, False, 1),
        ("llama", 4, 1, 2, 2, "zb_v", 2, False, 3),  # dp=2, ZeRO-3
        ("llama", 4, 1, 2, 2, "dualpipe_v", 2, False, 3, (), (), 1),
        ("llama", 4, 1, 2, 2, "interleaved_zb", 2, False, 3),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(V_CASES))
def test_v_and_interleaved_zero_bubble_schedules_match_one_process(world):
    run_world(world, V_CASES[world])


# parallel.stage_layers and model.recompute_layers, as tools/plan.py --per-layer writes them.
MIXED = ("full", "none", "selective", "none", "full", "none")
PLANNED_CASES = [
    ("llama", 6, 1, 2, 1, "1f1b", 1, False, 0, (5, 1), MIXED),
    ("gpt", 6, 1, 2, 1, "interleaved_1f1b", 2, False, 0, (1, 3, 1, 1), MIXED),
]
ZERO_BUBBLE_TP = "zero bubble under tp"
"""The key of test_zero_bubble_defers_tensor_parallel_weight_gradients's traced runs in a rank's results."""
WORLD_CASES = {
    world: arch_layout_cases(world) + V_CASES.get(world, []) + (PLANNED_CASES if world == 2 else [])
    for world in sorted(LAYOUTS)
}


class GradientArrivals:
    """When each linear-layer weight (nn.Linear, TP column/row parallel) of a rank's stages receives its
    gradient, so a traced step shows which action computed it."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def watch(self, stages: nn.Module) -> None:
        for name, module in stages.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or type(module) is nn.Linear:
                self.times[name] = []
                module.weight.register_post_accumulate_grad_hook(
                    lambda _p, times=self.times[name]: times.append(time.perf_counter())
                )

    def kinds(self, trace: list[dict]) -> dict[str, list[tuple[str, int]]]:
        """Per layer, the (kind, micro-batch) of the traced actions its gradients arrived in."""
        return {
            name: [(e["kind"], e["microbatch"]) for t in times for e in trace if e["start"] <= t <= e["end"]]
            for name, times in self.times.items()
        }


@pytest.mark.slow
def test_pp1_is_the_degenerate_case_of_the_same_executor():
    job = make_job("ernie", 2)
    for name in ("1f1b", "zb_h1"):
        job.parallel.schedule = name
        arrivals = GradientArrivals()
        result = run(job, Topology.single(), trace=True, setup=arrivals.watch)
        # The trace holds every compute action of the schedule.
        kinds = [e["kind"] for e in result["trace"]]
        assert kinds == [a.kind for a in build_schedule(name, 1, 4).compute(0)]
        # Zero-bubble W really computes the weight gradients: one per micro-batch for each linear layer,
        # except the head tied to the embedding, which keeps its gradient in I.
        expected = "W" if name == "zb_h1" else "B"
        for layer, got in arrivals.kinds(result["trace"]).items():
            want = [
                ("I" if layer == "chunks.0.lm_head" and name == "zb_h1" else expected, mb) for mb in range(4)
            ]
            assert got == want, (name, layer, got)
        check(name, job, result)


def _traced_under_tp(job: JobConfig) -> bool:
    """Whether a case is one of test_zero_bubble_defers_tensor_parallel_weight_gradients's runs: the world-4
    matrix's zb_h1 cases at tp=2, pp=2 (the layout/schedule cell without sequence parallelism, the TP cases
    with it), traced while they are checked against one process. Tracing and the gradient hooks change no
    value, so a separate traced run of the same job would only repeat the matrix's."""
    p = job.parallel
    return (p.schedule, p.tp, p.pp, p.dp) == ("zb_h1", 2, 2, 1)


@pytest.mark.slow
def test_zero_bubble_defers_tensor_parallel_weight_gradients():
    """zb_h1 at tp=2, pp=2: the W actions compute the weight gradients of the column/row parallel layers
    after their I (several other actions later on the last pipeline rank), and the run matches one process.
    Traced in the world-4 group of the matrix tests (_world_results, _traced_under_tp)."""
    world = 4
    results = _world_results(world)
    errors = [r for r in results.values() if isinstance(r, str)]
    assert not errors, "\n".join(errors)
    cases = list(results[0][ZERO_BUBBLE_TP])
    assert {make_job(*case).parallel.sequence_parallel for case in cases} == {False, True}, cases
    failures = [f for case in cases for r in range(world) for f in results[r][case]]
    assert not failures, "\n".join(failures)  # each matched one process
    for case in cases:
        for rank in range(world):
            r = results[rank][ZERO_BUBBLE_TP][case]
            # Every linear layer of the rank's stage, all of them tensor-parallel here, got its weight
            # gradient of micro-batch i in the W of micro-batch i, once.
            assert len(r["arrivals"]) >= 12, r["arrivals"]
            for layer, got in r["arrivals"].items():
                assert got == [("W", mb) for mb in range(4)], (case, rank, layer, got)
            trace = r["trace"]
            computes = [(e["kind"], e["microbatch"]) for e in trace]
            end_of_i = {e["microbatch"]: e["end"] for e in trace if e["kind"] == "I"}
            assert all(e["start"] >= end_of_i[e["microbatch"]] for e in trace if e["kind"] == "W")
            # ZB-H1 runs W(i - r) after I(i) on pipeline rank r: right after its I on rank 0, deferred
            # past later actions on rank 1.
            delays = [computes.index(("W", mb)) - computes.index(("I", mb)) for mb in range(4)]
            pp_rank = trace[0]["rank"]
            assert max(delays) > 1 if pp_rank == 1 else delays == [1, 1, 1, 1], (pp_rank, delays)
    # Deferring W shrinks the simulated bubble below 1F1B's for this pipeline.
    costs = dict(forward=1.0, backward=2.0, weight_grad=1.0)
    zb = simulate(build_schedule("zb_h1", 2, 4), **costs).bubble_fraction
    one = simulate(build_schedule("1f1b", 2, 4), costs["forward"], costs["backward"]).bubble_fraction
    assert zb < one


@pytest.mark.slow  # two gloo processes
def test_a_planned_split_and_per_layer_recomputation_train_like_one_process():
    """parallel.stage_layers and model.recompute_layers, as tools/plan.py --per-layer writes them."""
    run_world(2, PLANNED_CASES)


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
