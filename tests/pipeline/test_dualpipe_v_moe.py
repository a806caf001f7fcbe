"""DualPipeV on a mixture of experts split over two EP ranks (pp=2, ep=2: the experts of every chunk
exchanged by all-to-all between the two data-parallel pipelines) trains like one process: losses, gradient
norms and weights against the float64 one-process run within the fp32 bounds of tests/parallel/_reference.py.
dualpipe_v needs 2 pp = 4 micro-batches per pipeline: micro-batch size 1, 4 of the 8 sequences per
data-parallel rank. (zb_v with ep=2: tests/parallel/test_moe_router_layouts.py.)"""

from __future__ import annotations

import pytest

from tests.parallel._dist import spawn
from tests.parallel._reference import train_layouts

LAYOUTS = [
    (
        "mixtral",
        dict(schedule="dualpipe_v", pp=2, ep=2, virtual_stages=2, num_layers=4, micro_batch_size=1),
        "adamw",
    )
]


@pytest.mark.slow
def test_dualpipe_v_with_ep2_trains_like_one_process():
    failures = [f for r in spawn(4, train_layouts, LAYOUTS) for f in r]
    assert not failures, "\n".join(failures)
