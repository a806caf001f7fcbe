"""The cost model's collectives (CostModel.collectives) against those one real training step issues on gloo.

Each case trains two steps of a tiny model on 2 or 4 processes, records the second step's torch.distributed
traffic (tests/planner/_trace.py) and compares it, per rank, with the planner's list for that rank's
pipeline stage: tensor- and pipeline-parallel traffic exactly (operation, group, bytes, count); the
data-parallel gradient buckets by total bytes per operation (the trainer closes buckets on parameter
boundaries, the model splits the same bytes into equal buckets: collectives.buckets), up to the padding of
each bucket to a multiple of dp elements. Under context parallelism the gradient buckets are reduced over
the cp x dp group (named "cp" when dp is 1), and the ring's K/V sends and the all-to-alls are exact rows.
Under expert parallelism the row exchanges depend on the routing: see test_expert_parallel_collectives_match.
"""

from __future__ import annotations

from collections import Counter

import pytest

from llmtrain import models
from llmtrain.parallel import (
    Topology,
    apply_cp,
    apply_recompute,
    apply_tp,
    build_optimizer,
    grad_sync,
    parallelize,
)
from llmtrain.pipeline.executor import build_pipeline
from llmtrain.planner import CostModel, Workload, load_cluster
from llmtrain.planner.cost.collectives import COUNT_BYTES, Comm
from llmtrain.planner.cost.layout import Software, layout_of_job
from tests.parallel._dist import SpawnedCases, batches, tiny_job
from tests.planner._trace import Tracer

pytestmark = pytest.mark.slow

GRAD_OPS = ("all_reduce", "reduce_scatter", "all_gather", "send")
DP_BUCKETS = {"dp": GRAD_OPS}
"""Group -> operations whose traffic is the gradient buckets' (compared by total bytes)."""


def _traced_step(rank: int, world: int, arch: str, overrides: dict) -> tuple[int, Counter[Comm]]:
    """(pipeline rank, the collectives of the second training step) of this rank."""
    job = tiny_job(arch, **overrides)
    topo = Topology(job.parallel, world, rank)
    model = models.empty_model(job.model, device="meta")
    pipelined = topo.pp > 1
    if pipelined:
        apply_tp(model, topo, job.parallel.sequence_parallel, job.train.seed)
        apply_cp(model, topo, job.parallel.cp_comm)
        apply_recompute(model, job.model.recompute, job.model.recompute_layers)
        model, executor = build_pipeline(model, topo, job)
    else:
        parallelize(model, topo, job)
    opt = build_optimizer(model, topo, job)
    tracer = Tracer(topo)
    micro = job.train.micro_batch_size
    for step, batch in enumerate(batches(job, 2)):
        mine = list(batch.chunk(topo.dp)[topo.dp_rank].split(micro))
        tracer.enabled = step == 1
        with tracer.recording():
            opt.zero_grad()
            if pipelined:
                executor.run(mine)
            else:
                for i, mb in enumerate(mine):
                    with grad_sync(model, i == len(mine) - 1):
                        opt.backward(model(mb[:, :-1], mb[:, 1:]) / len(mine))
            opt.step(1e-3)
    return topo.pp_rank, tracer.counts()


def _predicted(arch: str, overrides: dict, world: int, pp_rank: int) -> Counter[Comm]:
    job = tiny_job(arch, **overrides)
    work = Workload.from_job(job)
    cost = CostModel(work, load_cluster("a100-80gb").view(world), Software(gloo_shard_exchange=True))
    return cost.collectives(layout_of_job(job, world), pp_rank)


def _split(
    counts: Counter[Comm], buckets: dict[str, tuple[str, ...]] | None
) -> tuple[Counter[Comm], dict[tuple[str, str], int]]:
    """(everything but the data-parallel buckets, the buckets' total bytes per operation and group);
    `buckets` names the groups and operations the buckets travel on; without it everything is compared
    exactly."""
    exact: Counter[Comm] = Counter()
    totals: dict[tuple[str, str], int] = {}
    for c, n in counts.items():
        if buckets and c.op in buckets.get(c.group, ()) and c.nbytes > 8:
            totals[c.op, c.group] = totals.get((c.op, c.group), 0) + c.nbytes * n
        else:
            exact[c] = n
    return exact, totals


def _check(
    traced_ranks: list[tuple[int, Counter[Comm]]],
    arch: str,
    world: int,
    overrides: dict,
    bucket_slack: int | None = None,
    buckets: dict[str, tuple[str, ...]] = DP_BUCKETS,
) -> None:
    """Traced (each rank's _traced_step) against predicted on every rank; `bucket_slack`: compare gradient
    buckets (the `buckets` groups' operations) by total bytes, to within that many bytes."""
    for pp_rank, traced in traced_ranks:
        predicted = _predicted(arch, overrides, world, pp_rank)
        got, got_totals = _split(traced, buckets if bucket_slack is not None else None)
        want, want_totals = _split(predicted, buckets if bucket_slack is not None else None)
        assert got == want, f"pp rank {pp_rank}: traced {sorted(got.items(), key=str)}\n" \
            f"predicted {sorted(want.items(), key=str)}"  # fmt: skip
        assert got_totals.keys() == want_totals.keys()
        for op, total in got_totals.items():
            assert abs(total - want_totals[op]) <= (bucket_slack or 0), (op, total, want_totals[op])


MODEL_PARALLEL = {
    "tp": ("llama", 2, dict(tp=2)),
    "tp-full-recompute": ("gpt", 2, dict(tp=2, recompute="full")),
    "tp-sp": ("llama", 2, dict(tp=2, sequence_parallel=True)),
    "tp-sp-full-recompute": ("gpt", 2, dict(tp=2, sequence_parallel=True, recompute="full")),
    # MoE layers keep their weights whole under TP and route a slice of the sequence (gathered back without
    # SP); their router, shared and expert gradients join the TP all-reduce of partial sums.
    "moe-tp": ("mixtral", 2, dict(tp=2)),
    "moe-tp-sp-full-recompute": ("mixtral", 2, dict(tp=2, sequence_parallel=True, recompute="full")),
    # Latent attention: q/kv up-projections column-parallel, o_proj row-parallel, the down-projections
    # and their norms whole on every TP rank, their gradients summed over TP.
    "mla-tp": ("deepseek_v3", 2, dict(tp=2)),
    "mla-tp-sp": ("deepseek_v3", 2, dict(tp=2, sequence_parallel=True)),
    "pp-1f1b-tied": ("gpt", 2, dict(pp=2)),
    "pp-interleaved": ("llama", 2, dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_layers=4)),
    "zb_h1-tp-sp": ("llama", 4, dict(tp=2, pp=2, schedule="zb_h1", sequence_parallel=True)),
    # ZB-V: the tied embedding at both ends of the V on rank 0 (no pair to sum), the V's bottom local.
    "zb_v-tied": ("gpt", 2, dict(pp=2, schedule="zb_v", virtual_stages=2, num_layers=4)),
    # tp=4 over 2 kv heads: each kv head on two ranks, their k/v gradients summed by one all-gather.
    "tp4-kv-replicas-sp": ("llama", 4, dict(tp=4, sequence_parallel=True)),
    "per-layer-plan": (
        "gpt",
        4,
        dict(
            tp=2, pp=2, num_layers=4, stage_layers=[3, 1], recompute_layers=["full", "none", "none", "full"]
        ),
    ),
}
# train.optimizer=muon: one fp32 all-reduce over tp (x cp x dp) of the stage's matrices, whole (attention
# and MLP; latent attention's projections and every expert's).
MODEL_PARALLEL["muon-tp-sp"] = ("llama", 2, dict(tp=2, sequence_parallel=True, optimizer="muon"))
MODEL_PARALLEL["muon-mla-moe-tp"] = ("deepseek_v3", 2, dict(tp=2, optimizer="muon"))
DATA_PARALLEL = {f"zero{zero}": ("llama", 2, dict(dp=2, zero_stage=zero)) for zero in (0, 1)}
# The gradient bytes of a TP rank of latent attention (down-projections whole) and of MoE layers (whole).
DATA_PARALLEL["mla-tp2-zero0"] = ("deepseek_v3", 4, dict(tp=2, dp=2))
# FSDP2 units (blocks, embedding, output layer, root) are counted exactly: gathers per micro-batch,
# reduce-scatters per micro-batch (grad_reduce=step: one per step), over the cp x dp ranks ("cp" at dp=1).
FSDP = {
    "zero2": ("llama", 2, dict(dp=2, zero_stage=2)),
    "zero2-step": ("llama", 2, dict(dp=2, zero_stage=2, grad_reduce="step")),
    "zero3": ("llama", 2, dict(dp=2, zero_stage=3)),
    "zero3-gpt-tied": ("gpt", 2, dict(dp=2, zero_stage=3)),
    "zero3-tp-sp": ("llama", 4, dict(dp=2, zero_stage=3, tp=2, sequence_parallel=True)),
    "zero3-cp": ("llama", 2, dict(dp=1, zero_stage=3, cp=2)),
}
# ring: per layer and micro-batch cp-1 K/V sends forward, 2cp-1 (K/V and dK/dV) backward, the forward's
# again under recomputation; all_to_all: q, k, v and the output forward and backward (at tp=2 a rank's one
# kv head repeated to cp=2). Under pp the loss's sums over cp run on the last stage. The buckets are
# all-reduced over cp x dp ("cp" at dp=1) or, at zero 1, exchanged with the 3 peers of the cp x dp group;
# each padded to the group's size.
CONTEXT_PARALLEL = {
    "ring-pp-selective": ("llama", 4, dict(cp=2, pp=2, recompute="selective"), {"cp": ("all_reduce",)}),
    "all_to_all-tp-sp": (
        "llama",
        4,
        dict(tp=2, cp=2, sequence_parallel=True, cp_comm="all_to_all"),
        {"cp": ("all_reduce",)},
    ),
    "all_to_all-zero1-dp": (
        "llama",
        4,
        dict(cp=2, dp=2, zero_stage=1, cp_comm="all_to_all"),
        dict.fromkeys(("cp", "dp", "cp+dp"), ("send",)),
    ),
}
EXPERT_PARALLEL = {
    "ep2": ("mixtral", 2, dict(dp=2, ep=2)),
    "ep2-expert-dp2-full-recompute": ("mixtral", 4, dict(dp=4, ep=2, recompute="full")),
    "ep2-cp2-dp2": ("mixtral", 4, dict(cp=2, dp=2, ep=2)),
    # EP spanning the TP pair: each TP rank dispatches the 1/tp of the sequence it routes.
    "ep2-tp2": ("mixtral", 2, dict(tp=2, ep=2)),
    "ep2-tp2-sp": ("mixtral", 2, dict(tp=2, ep=2, sequence_parallel=True)),
    # FSDP2: the experts in units of their own over the expert-DP ranks.
    "ep2-zero3": ("mixtral", 2, dict(dp=2, ep=2, zero_stage=3)),
    # EP inside dp at tp=2: the TP pair holds the same experts, their expert-DP group (edp = tp x dp / ep).
    "ep2-tp2-dp2": ("mixtral", 4, dict(tp=2, dp=2, ep=2)),
    # ZeRO-1 on gloo: the experts' shards exchanged with the peer holding the same experts (dp ranks 2 apart).
    "ep2-dp4-zero1": ("mixtral", 4, dict(dp=4, ep=2, zero_stage=1)),
    "ep2-tp2-dp2-zero3": ("mixtral", 4, dict(tp=2, dp=2, ep=2, zero_stage=3, sequence_parallel=True)),
    # No dense data parallelism (dp = 1) yet the experts' FSDP2 units shard over the TP pair holding them.
    "ep2-tp4-zero3": ("mixtral", 4, dict(tp=4, ep=2, zero_stage=3)),
}
_GROUPS = {
    "model": MODEL_PARALLEL,
    "data": DATA_PARALLEL,
    "fsdp": FSDP,
    "cp": CONTEXT_PARALLEL,
    "ep": EXPERT_PARALLEL,
}


@pytest.fixture(scope="module")
def traced() -> SpawnedCases:
    """Each rank's _traced_step of every case ("<group>/<id>"), one gloo group per world size."""
    return SpawnedCases(
        _traced_step,
        {
            f"{group}/{name}": (world, (arch, overrides))
            for group, cases in _GROUPS.items()
            for name, (arch, world, overrides, *_) in cases.items()
        },
    )


@pytest.mark.parametrize("case", MODEL_PARALLEL)
def test_model_parallel_collectives_match_the_trace(traced: SpawnedCases, case: str) -> None:
    _check(traced(f"model/{case}"), *MODEL_PARALLEL[case])


@pytest.mark.parametrize("case", DATA_PARALLEL)
def test_data_parallel_bytes_match_the_trace(traced: SpawnedCases, case: str) -> None:
    # Each of the ~10 buckets is padded to a multiple of dp=2 elements (4 bytes each, fp32 gradients).
    _check(traced(f"data/{case}"), *DATA_PARALLEL[case], bucket_slack=2 * 4 * 2 * 16)


@pytest.mark.parametrize("case", FSDP)
def test_fsdp_collectives_match_the_trace(traced: SpawnedCases, case: str) -> None:
    _check(traced(f"fsdp/{case}"), *FSDP[case])


@pytest.mark.parametrize("case", CONTEXT_PARALLEL)
def test_context_parallel_collectives_match_the_trace(traced: SpawnedCases, case: str) -> None:
    arch, world, overrides, buckets = CONTEXT_PARALLEL[case]
    group = overrides.get("dp", 1) * overrides["cp"]
    _check(traced(f"cp/{case}"), arch, world, overrides, bucket_slack=2 * 4 * group * 16, buckets=buckets)


def _row_exchanges(counts: Counter[Comm], experts: int) -> tuple[Counter[Comm], Counter[Comm]]:
    """(everything else, the EP all-to-alls of routed rows: all but the per-expert count exchanges)."""
    rows = Counter({c: n for c, n in counts.items() if c.group == "ep" and c.nbytes != COUNT_BYTES * experts})
    return counts - rows, rows


@pytest.mark.parametrize("case", EXPERT_PARALLEL)
def test_expert_parallel_collectives_match_the_trace(traced: SpawnedCases, case: str) -> None:
    # Per MoE layer and micro-batch: the count exchange (E int64) and the dispatch and combine forward,
    # their reverses backward (the forward's again under full recomputation). A rank's all-to-all bytes
    # are what it sends: all its own routed rows (tokens x top-k, dropless) in the dispatch and in the
    # combine's backward, exactly as predicted (a TP rank routes 1/tp of the tokens, with or without SP);
    # in the other two the rows routed to its experts, which
    # depend on the routing. The model assumes balanced routing (as many received as sent); routing here
    # is whatever the random weights choose, but each row one rank receives is one another sends, so over
    # the EP group the received rows add up to the sent ones: the row exchanges' bytes summed over the
    # world (whole EP groups) are exact. Everything else is exact per rank, the dense buckets over dp (cp x
    # dp under cp) and the experts' over the expert-DP group ("edp", tp x cp x dp / ep ranks: none at
    # dp = ep without cp or tp, the CP pair at cp=2 dp=2 ep=2, the TP pair at tp=2 dp=2 ep=2; FSDP2 expert
    # units there exactly) by total bytes, and at zero 1 the gloo shard exchange's sends to the dense and
    # the expert peers (all DP ranks here) by total bytes too.
    experts = tiny_job("mixtral").model.num_experts
    buckets = {"dp": ("all_reduce", "send"), "cp+dp": ("all_reduce",), "edp": ("all_reduce",)}
    traced_rows = predicted_rows = 0
    _, world, overrides = EXPERT_PARALLEL[case]
    for pp_rank, counts in traced(f"ep/{case}"):
        predicted = _predicted("mixtral", overrides, world, pp_rank)
        (got, got_rows), (want, want_rows) = (_row_exchanges(c, experts) for c in (counts, predicted))
        assert got_rows.total() == want_rows.total() > 0, (got_rows, want_rows)
        [(own, sends)] = want_rows.items()  # one size predicted: the rank's own rows
        assert got_rows[own] >= sends // 2, (got_rows, own)  # dispatch and combine backward, exact
        traced_rows += sum(c.nbytes * n for c, n in got_rows.items())
        predicted_rows += own.nbytes * sends
        (exact, totals), (want_exact, want_totals) = (_split(c, buckets) for c in (got, want))
        assert exact == want_exact, f"traced {sorted(exact.items(), key=str)}\n" \
            f"predicted {sorted(want_exact.items(), key=str)}"  # fmt: skip
        assert totals.keys() == want_totals.keys()
        for key, total in totals.items():
            # fp32 gradients (4 bytes): the trainer pads each of its (at most 16) buckets to a multiple of
            # the group's ranks; the model's equal buckets (at most 32) round the total down by less than
            # one element each.
            slack = 4 * (16 * world + 32)
            assert abs(total - want_totals[key]) <= slack, (key, total, want_totals[key])
    assert traced_rows == predicted_rows
