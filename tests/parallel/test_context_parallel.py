"""Context parallelism (llmtrain.parallel.context_parallel): the split and its inverse, ring and all-to-all
attention against full attention in float64 (outputs and gradients, causal, grouped-query), layouts with cp
training like one process, and the config errors of impossible splits."""

from __future__ import annotations

import functools

import pytest
import torch

from llmtrain.parallel import Topology
from llmtrain.parallel.context_parallel import (
    ContextSplit,
    all_to_all_attention,
    local_positions,
    merge_sequence,
    ring_attention,
    split_sequence,
)
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job
from tests.parallel._reference import torch_reference


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_is_mirrored_and_merge_inverts_it(cp: int) -> None:
    seq = 8 * cp
    x = torch.arange(seq)[None].repeat(2, 1)
    parts = [split_sequence(x, cp, r) for r in range(cp)]
    c = seq // (2 * cp)
    for r, part in enumerate(parts):
        # Rank r holds chunk r and chunk 2cp-1-r, and the positions of exactly those tokens.
        mirror = 2 * cp - 1 - r
        want = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])
        assert torch.equal(part[0], want)
        assert torch.equal(local_positions(seq, cp, r), want)
    assert torch.equal(merge_sequence(parts), x)
    # Causal work is balanced: every rank's tokens see the same number of keys in total.
    work = {int((local_positions(seq, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention in the input dtype: the reference."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


ATTENTION_CASES = [  # (comm, heads, kv heads): MHA, GQA, and kv heads fewer than cp ranks (replicated)
    ("ring", 4, 4),
    ("ring", 4, 2),
    ("ring", 4, 1),
    ("all_to_all", 4, 4),
    ("all_to_all", 4, 2),
    ("all_to_all", 4, 1),
]


def _attention_against_full(rank: int, world: int) -> list[str]:
    from torch.distributed import new_group

    group = new_group(list(range(world)))
    split = ContextSplit(world, rank, group, (rank + 1) % world, (rank - 1) % world)
    failures = []
    for comm, heads, kv in ATTENTION_CASES:
        g = torch.Generator().manual_seed(heads * 10 + kv)
        b, seq, d = 2, 8 * world, 8
        q = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, kv, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, kv, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
        want = _full_attention(q, k, v)
        want.backward(dout)
        mine = [split_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
        split.comm = comm
        if comm == "ring":
            out = ring_attention(*mine, split)
        else:
            out = all_to_all_attention(*mine, split, impl="torch")
        out.backward(split_sequence(dout, world, rank, dim=2))
        got = [out] + [t.grad for t in mine]
        expected = [want] + [t.grad for t in (q, k, v)]
        for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            e = split_sequence(e, world, rank, dim=2)
            err = (a - e).abs().max().item()
            if not err <= 1e-12:
                case = f"{comm} heads={heads} kv={kv} cp={world} rank {rank}"
                failures.append(f"{case}: {name} off by {err:.2e}")
    return failures


@functools.cache
def _attention_results(world: int) -> list[list[str]]:
    return spawn(world, _attention_against_full)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_full_attention_in_float64(world: int) -> None:
    failures = [f for r in _attention_results(world) for f in r]
    assert not failures, "\n".join(failures)


STEPS = 3
LR = 1e-3
REL_GAP = 1e-4  # worst relative gap of the losses and gradient norms to the single-process run
# (arch, parallel settings) per world size: the layouts of issue 17, GQA with kv heads fewer than cp ranks,
# sequence parallelism and learned positions (gpt) among them.
LAYOUTS = {
    2: [
        ("llama", dict(cp=2)),
        ("gpt", dict(cp=2)),
        ("llama", dict(cp=2, cp_comm="all_to_all")),
    ],
    4: [
        ("llama", dict(cp=4)),
        ("ernie", dict(cp=4, cp_comm="all_to_all")),
        ("llama", dict(cp=4, cp_comm="all_to_all")),
        ("llama", dict(cp=2, tp=2, sequence_parallel=True)),
        ("gpt", dict(cp=2, pp=2)),
        ("llama", dict(cp=2, dp=2, zero_stage=1)),
    ],
}


def _train_layouts(rank: int, world: int) -> list[str]:
    failures = []
    references = {}
    for arch, settings in LAYOUTS[world]:
        job = tiny_job(arch, **settings)
        data = batches(job, STEPS)
        run = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
        if rank != 0:
            continue
        if arch not in references:
            references[arch] = torch_reference(job, data, LR)
        ref = references[arch]
        name = f"{arch} {' '.join(f'{k}={v}' for k, v in settings.items())}"
        failures += ref.check(name, run["losses"], run["grad_norms"], run["state"])
        for kind, got, want in (
            ("loss", run["losses"], ref.losses),
            ("grad norm", run["grad_norms"], ref.grad_norms),
        ):
            gap = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            if not gap <= REL_GAP:
                failures.append(f"{name}: {kind} relative gap {gap:.1e} to one process")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_layouts_train_like_one_process(world: int) -> None:
    failures = [f for r in spawn(world, _train_layouts) for f in r]
    assert not failures, "\n".join(failures)
