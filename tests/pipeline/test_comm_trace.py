"""The traced transfers' accounting (llmtrain.pipeline.comm_trace) on made-up events: what counts as exposed
communication (waiting after the producer finished) and what as hidden, and the recorder's fields; and a
traced gloo run of dualpipe_v records each of its transfers once. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from llmtrain.models import build
from llmtrain.parallel import Topology
from llmtrain.pipeline.comm_trace import (
    CommEvent,
    CommTrace,
    collective_overlap,
    computing,
    exposed,
    hidden_receives,
    in_flight,
    nested_collectives,
)
from llmtrain.pipeline.executor import build_pipeline
from llmtrain.pipeline.schedules import RECV_B, RECV_F, SEND_F, Action, build_schedule
from llmtrain.pipeline.timeline import Span
from tests.parallel._dist import batches, spawn, tiny_job

# pp=2 1F1B: rank 1 receives F of micro-batch 0 from rank 0, rank 0 the gradient from rank 1.
SCHEDULE = build_schedule("1f1b", 2, 2)
SPANS = [Span(0, "F", 0, 0, 0.0, 1.0), Span(1, "F", 0, 0, 1.5, 2.5), Span(1, "B", 0, 0, 2.5, 4.5)]


def _recv(kind, rank, posted, needed, done):
    return CommEvent(rank, kind, 0, 0, posted, needed, done)


def test_exposed_counts_only_the_wait_after_the_producer_finished():
    events = [
        # Rank 1 needed F0 at 0.2 but rank 0 produced it at 1.0: it waited 1.3, of which 0.3 for the transfer.
        _recv(RECV_F, 1, 0.1, 0.2, 1.3),
        # Rank 0's gradient arrived before it was needed: nothing exposed, hidden.
        _recv(RECV_B, 0, 1.1, 6.0, 6.00001),
        CommEvent(0, SEND_F, 0, 0, 1.0, 7.0, 7.5),  # sends are not receives: never counted
    ]
    assert exposed(SCHEDULE, SPANS, events) == pytest.approx(0.3 + 0.00001)
    assert hidden_receives(events) == (1, 2)
    # The transfer window starts when the receive is both posted and produced.
    assert in_flight(SCHEDULE, SPANS, events) == [(1, 1.0, 1.3), (0, 4.5, 6.00001)]


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


# An overlapped pair on one rank: F of micro-batch 1 computes 0-1, issues an all-to-all at 1 and passes the
# turn; B of micro-batch 0 gets it at 1.1, computes to 3, issues its own and passes the turn back; F waits
# 3-3.5 for its exchange, computes to 4 and ends; B waits 4-4.25 for its own and computes to 5.
PAIR_SPANS = [Span(0, "F", 1, 0, 0.0, 4.0), Span(0, "B", 0, 1, 1.1, 5.0)]
PAIR_A2A = [CommEvent(0, "F", 1, 0, 1.0, 3.0, 3.5), CommEvent(0, "B", 0, 1, 3.0, 4.0, 4.25)]


def test_a_pairs_all_to_alls_hide_behind_the_other_micro_batchs_compute():
    b_first, f_last = Span(0, "B", 0, 1, 1.1, 3.0), Span(0, "F", 1, 0, 3.5, 4.0)
    assert computing(PAIR_SPANS, PAIR_A2A) == [
        Span(0, "F", 1, 0, 0.0, 1.0),
        f_last,
        b_first,
        Span(0, "B", 0, 1, 4.25, 5.0),
    ]
    # The exchanges' union 1-4.25: 1.1-3 under B's compute and 3.5-4 under F's are hidden; 1-1.1 (the
    # hand-over), 3-3.5 and 4-4.25 (a side waiting for its exchange, the other idle) exposed.
    assert collective_overlap(PAIR_SPANS, PAIR_A2A) == pytest.approx((0.85, 2.4))
    assert nested_collectives(PAIR_SPANS, PAIR_A2A) == [(PAIR_A2A[0], b_first), (PAIR_A2A[1], f_last)]


def test_without_a_pair_the_all_to_alls_are_exposed_and_nest_in_nothing():
    spans = [Span(0, "F", 1, 0, 0.0, 2.0), Span(0, "B", 0, 1, 2.0, 4.0)]
    a2a = [CommEvent(0, "F", 1, 0, 1.0, 1.0, 1.5), CommEvent(0, "B", 0, 1, 3.0, 3.0, 3.25)]
    assert collective_overlap(spans, a2a) == pytest.approx((0.75, 0.0))
    assert nested_collectives(spans, a2a) == []


def test_the_recorder_keeps_posted_needed_done_in_order():
    trace = CommTrace(rank=1)
    work = _Work()
    trace.posted(3, Action(RECV_F, 0, 0, peer=0))
    trace.wait(3, work)
    (event,) = trace.events
    assert work.waited
    assert {k: event[k] for k in ("rank", "kind", "microbatch", "chunk")} == {
        "rank": 1, "kind": RECV_F, "microbatch": 0, "chunk": 0,
    }  # fmt: skip
    assert event["posted"] <= event["needed"] <= event["done"]
    CommEvent(**event)  # the bench rebuilds events from the gathered dicts


def _traced_dualpipe_v(rank: int, world: int) -> tuple[list[dict], list[dict]]:
    job = tiny_job("llama", pp=2, virtual_stages=2, schedule="dualpipe_v", num_layers=4)
    topo = Topology(job.parallel, world, rank)
    torch.manual_seed(0)
    _, executor = build_pipeline(build(job.model), topo, job)
    (batch,) = batches(job, 1)
    executor.run(list(batch.split(job.train.micro_batch_size)), trace=True)
    return executor.trace, executor.comm_trace


@pytest.mark.slow
def test_a_traced_gloo_run_records_every_transfer_of_the_schedule():
    schedule = build_schedule("dualpipe_v", 2, 4, 2)
    traces = spawn(2, _traced_dualpipe_v)
    spans = [Span(**e) for trace, _ in traces for e in trace]
    events = [CommEvent(**e) for _, comms in traces for e in comms]
    for rank in range(2):
        want = sorted((a.kind, a.microbatch, a.chunk) for a in schedule.actions[rank] if a.is_comm)
        got = sorted((e.kind, e.microbatch, e.chunk) for e in events if e.rank == rank)
        assert got == want
    assert all(e.posted <= e.needed <= e.done for e in events)
    assert all(start <= end for _, start, end in in_flight(schedule, spans, events))
    assert exposed(schedule, spans, events) >= 0.0
