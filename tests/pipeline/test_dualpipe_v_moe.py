"""DualPipeV on a mixture of experts split over two EP ranks (pp=2, ep=2: the experts of every chunk
exchanged by all-to-all between the two data-parallel pipelines) trains like one process: losses, gradient
norms and weights against the float64 one-process run within the fp32 bounds of tests/parallel/_reference.py.
dualpipe_v needs 2 pp = 4 micro-batches per pipeline: micro-batch size 1, 4 of the 8 sequences per
data-parallel rank. (zb_v with ep=2: tests/parallel/test_moe_router_layouts.py.)

In the same processes, one traced step with the overlapped pairs and one without: with them, some all-to-all
of one micro-batch is issued before a compute interval of another micro-batch on the same rank begins and
returns after it ends (the exchange ran while the other computed); without them none is. Only the order of
the time stamps counts (llmtrain.pipeline.comm_trace.nested_collectives), no duration."""

from __future__ import annotations

import pytest

from llmtrain.parallel import Topology
from llmtrain.pipeline.comm_trace import CommEvent, nested_collectives
from llmtrain.pipeline.timeline import Span
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job
from tests.parallel._reference import train_layouts

LAYOUTS = [
    (
        "mixtral",
        dict(schedule="dualpipe_v", pp=2, ep=2, virtual_stages=2, num_layers=4, micro_batch_size=1),
        "adamw",
    )
]


def _train_then_trace(rank: int, world: int) -> tuple[list[str], dict[bool, tuple[int, int]]]:
    """train_layouts' failures, and per overlap setting (nested pairs, all-to-alls) of one traced step."""
    failures = train_layouts(rank, world, LAYOUTS)
    arch, settings, _ = LAYOUTS[0]
    job = tiny_job(arch, **settings)
    topo = Topology(job.parallel, world, rank)
    executor = parallel_run(job, topo, [])["executor"]
    micro = list(batches(job, 1)[0].chunk(topo.dp)[topo.dp_rank].split(job.train.micro_batch_size))
    found = {}
    for overlap in (True, False):
        executor.overlap = overlap
        executor.run(micro, trace=True)
        spans = [Span(**e) for e in executor.trace]
        collectives = [CommEvent(**e) for e in executor.collective_trace]
        found[overlap] = (len(nested_collectives(spans, collectives)), len(collectives))
    return failures, found


@pytest.mark.slow
def test_dualpipe_v_with_ep2_trains_like_one_process_and_overlaps_its_all_to_alls():
    results = spawn(4, _train_then_trace)
    failures = [f for r in results for f in r[0]]
    assert not failures, "\n".join(failures)
    for rank, (_, found) in enumerate(results):
        (nested_on, total_on), (nested_off, total_off) = found[True], found[False]
        assert total_on == total_off > 0, (rank, found)
        assert nested_on > 0, f"rank {rank}: no all-to-all ran inside another micro-batch's compute"
        assert nested_off == 0, f"rank {rank}: {nested_off} all-to-alls nested without overlap"
