"""Context parallelism (llmtrain.parallel.context_parallel): the split and its inverse, ring and all-to-all
attention against full attention in float64 (outputs and gradients, causal, grouped-query), layouts with cp
training like one process, and the config errors of impossible splits."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from llmtrain.config import ConfigError, JobConfig, ParallelConfig, load, validate_world
from llmtrain.config.validate import rank_order
from llmtrain.parallel import Topology
from llmtrain.parallel.context_parallel import all_to_all_attention, ring_attention
from llmtrain.parallel.context_split import ContextSplit, local_positions, merge_sequence, split_sequence
from tests.models._packed import assert_packed_documents_equal_separate_runs
from tests.parallel._dist import SpawnedCases, batches, call, parallel_run, tiny_job
from tests.parallel._reference import LR, Layout, torch_reference, train_layouts


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


def _full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain causal attention in the input dtype (inside documents, if given): the reference."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if documents is not None:
        s = s.masked_fill((documents[:, :, None] != documents[:, None, :])[:, None], float("-inf"))
    return s.softmax(-1) @ v


def _documents(b: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """Random packed-document ids (b, seq): documents of 1 to seq/2 tokens."""
    ends = torch.rand(b, seq, generator=g) < 4 / seq
    return ends.long().cumsum(-1) - ends.long()


# (comm, heads, kv heads, packed documents): MHA, GQA, kv heads fewer than cp ranks (replicated), documents.
ATTENTION_CASES = [
    ("ring", 4, 4, False),
    ("ring", 4, 2, False),
    ("ring", 4, 1, False),
    ("ring", 4, 2, True),
    ("all_to_all", 4, 4, False),
    ("all_to_all", 4, 2, False),
    ("all_to_all", 4, 1, False),
    ("all_to_all", 4, 2, True),
]


def _attention_against_full(rank: int, world: int) -> list[str]:
    from torch.distributed import new_group

    group = new_group(list(range(world)))
    split = ContextSplit(world, rank, group, (rank + 1) % world, (rank - 1) % world)
    failures = []
    for comm, heads, kv, packed in ATTENTION_CASES:
        g = torch.Generator().manual_seed(heads * 10 + kv)
        b, seq, d = 2, 8 * world, 8
        q = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, kv, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, kv, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
        documents = _documents(b, seq, g) if packed else None
        want = _full_attention(q, k, v, documents)
        want.backward(dout)
        mine = [split_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
        split.comm = comm
        if comm == "ring":
            out = ring_attention(*mine, split, documents=documents)
        else:
            out = all_to_all_attention(*mine, split, impl="torch", documents=documents)
        out.backward(split_sequence(dout, world, rank, dim=2))
        got = [out] + [t.grad for t in mine]
        expected = [want] + [t.grad for t in (q, k, v)]
        for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            e = split_sequence(e, world, rank, dim=2)
            err = (a - e).abs().max().item()
            if not err <= 1e-12:
                case = f"{comm} heads={heads} kv={kv} packed={packed} cp={world} rank {rank}"
                failures.append(f"{case}: {name} off by {err:.2e}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_full_attention_in_float64(world: int, spawned: SpawnedCases) -> None:
    failures = [f for r in spawned(f"attention {world}") for f in r]
    assert not failures, "\n".join(failures)


# (arch, parallel settings) per world size: the layouts of issue 17, GQA with kv heads fewer than cp ranks,
# sequence parallelism and learned positions (gpt) among them.
LAYOUTS = {
    2: [
        ("llama", dict(cp=2)),
        ("gpt", dict(cp=2)),
        ("llama", dict(cp=2, cp_comm="all_to_all")),
        ("llama", dict(cp=2, recompute="selective")),
        ("ernie", dict(cp=2, recompute="full")),
        ("llama", dict(cp=2, packed=True)),
        ("gpt", dict(cp=2, cp_comm="all_to_all", packed=True)),
    ],
    4: [
        ("llama", dict(cp=4)),
        ("ernie", dict(cp=4, cp_comm="all_to_all")),
        ("llama", dict(cp=4, cp_comm="all_to_all")),
        ("llama", dict(cp=2, tp=2, sequence_parallel=True)),
        ("gpt", dict(cp=2, pp=2)),
        ("llama", dict(cp=2, pp=2, schedule="zb_h1")),
        ("gpt", dict(cp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_layers=4)),
        ("llama", dict(cp=2, dp=2, zero_stage=1)),
        ("ernie", dict(cp=2, tp=2, sequence_parallel=True, packed=True)),
    ],
}
# ZeRO-2/3 (FSDP2 over the cp x dp ranks, the gradient summed over cp and averaged over dp), hybrid sharding
# (a replica: dp_shard DP ranks and their CP ranks), cp alone sharding at dp=1, and zero-bubble's deferred
# weight gradients reduced by llmtrain.parallel.fsdp.finish_backward.
FSDP_LAYOUTS = {
    2: [("llama", dict(cp=2, zero_stage=3))],
    4: [
        ("llama", dict(cp=2, dp=2, zero_stage=2)),
        ("gpt", dict(cp=2, dp=2, zero_stage=3, cp_comm="all_to_all")),
        ("llama", dict(cp=2, dp=2, zero_stage=3, dp_shard=1)),
        ("llama", dict(cp=2, pp=2, zero_stage=3, schedule="zb_h1")),
    ],
}


def _adamw(layouts: list[tuple[str, dict]]) -> list[Layout]:
    return [(arch, settings, "adamw") for arch, settings in layouts]


def _fsdp_mesh(name: str, job: JobConfig, topo: Topology, run: dict[str, Any]) -> list[str]:
    """CP ranks hold shards, not copies: a replica is sharded over its dp_shard DP ranks times cp."""
    if job.parallel.zero_stage < 2:
        return []
    shard = (job.parallel.dp_shard or topo.dp) * topo.cp
    want = (shard,) if shard == topo.dp * topo.cp else (topo.dp * topo.cp // shard, shard)
    mesh = tuple(next(run["model"].parameters()).device_mesh.shape)
    return [] if mesh == want else [f"{name}: FSDP mesh {mesh}, expected {want}"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_layouts_train_like_one_process(world: int, spawned: SpawnedCases) -> None:
    failures = [f for r in spawned(f"layouts {world}") for f in r]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_cp_with_zero_2_and_3_trains_like_one_process(world: int, spawned: SpawnedCases) -> None:
    failures = [f for r in spawned(f"fsdp {world}") for f in r]
    assert not failures, "\n".join(failures)


def _train_ring_with_triton(rank: int, world: int) -> list[str]:
    # Ring attention's blocks (and every other op) in the Triton kernels, interpreted: 2 steps suffice to
    # carry the attention gradients into the weights and back into a second forward. One micro-batch a
    # step (global batch 2): the kernels see each micro-batch alike, and accumulation over micro-batches
    # under ring CP is checked by the PyTorch layouts of test_cp_layouts_train_like_one_process.
    job = tiny_job("llama", cp=2, kernels="triton", global_batch_size=2)
    data = batches(job, 2)
    run = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
    if rank != 0:
        return []
    ref = torch_reference(tiny_job("llama", global_batch_size=2), data, LR)
    return ref.check("llama cp=2 kernels=triton", run["losses"], run["grad_norms"], run["state"])


@pytest.fixture(scope="module")
def spawned() -> SpawnedCases:
    """Every multi-process check of this module, run as cases of one gloo group per world size (starting
    the processes costs more than most checks here)."""
    cases: dict[str, tuple[int, tuple]] = {"ring triton 2": (2, (_train_ring_with_triton,))}
    for world in (2, 4):
        cases[f"attention {world}"] = (world, (_attention_against_full,))
        cases[f"layouts {world}"] = (world, (train_layouts, _adamw(LAYOUTS[world])))
        cases[f"fsdp {world}"] = (world, (train_layouts, _adamw(FSDP_LAYOUTS[world]), _fsdp_mesh))
    return SpawnedCases(call, cases)


@pytest.mark.slow
def test_ring_with_triton_kernels_trains_like_one_process(spawned: SpawnedCases) -> None:
    """model.kernels=triton with parallel.cp_comm=ring: within the fp32 bounds of the float64 one-process
    run (tests/parallel/_reference.py), as the PyTorch ring layouts above."""
    failures = [f for r in spawned("ring triton 2") for f in r]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["parallel.cp=3", "model.seq_length=64"],
            "model.seq_length=64 is not divisible by 2 * parallel.cp = 6",
        ),
        (["parallel.cp=0"], "parallel.cp must be at least 1"),
        (
            ["parallel.cp=8", "parallel.cp_comm=all_to_all", "model.num_attention_heads=4"],
            "parallel.cp_comm=all_to_all scatters the attention heads over parallel.cp=8",
        ),
        (
            ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=all_to_all", "model.num_attention_heads=2"],
            "1 per tensor-parallel rank (parallel.tp=2); choose a cp dividing 1, or parallel.cp_comm=ring",
        ),
        (
            ["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_length=12"],
            "make seq_length a multiple of cp * tp = 8",
        ),
        (["parallel.cp=2", "model.attention_dropout=0.1"], "set model.attention_dropout=0"),
        (
            ["parallel.cp=2", "parallel.engine=deepspeed", "parallel.zero_stage=2"],
            "does not support parallel.engine=deepspeed yet; use parallel.engine=llmtrain",
        ),
        (
            ["parallel.cp=2", "model.arch=mixtral", "model.num_experts=8", "parallel.ep=8", "parallel.dp=1"],
            "parallel.ep=8 cannot be carved out of the tp x cp x dp = 1x2x1 ranks; choose an ep dividing",
        ),
        (["parallel.order=tp-dp-pp-cp-cp"], "parallel.order must name tp, dp and pp once each"),
        (
            ["data.reset_attention_mask=true", "parallel.pp=2"],
            "set parallel.pp=1 or data.reset_attention_mask",
        ),
    ],
)
def test_bad_cp_settings_name_the_field_and_the_fix(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(None, overrides)


def test_cp_takes_its_share_of_the_world() -> None:
    job = load(
        None, ["parallel.cp=2", "parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2"]
    )
    assert validate_world(job, 8) == 2  # dp = 8 / (tp * cp)
    # GQA with fewer kv heads than CP ranks: all_to_all replicates them.
    gqa = load(None, ["parallel.cp=4", "parallel.cp_comm=all_to_all", "model.num_kv_heads=1"])
    assert gqa.parallel.cp == 4
    with pytest.raises(ConfigError, match=re.escape("parallel.tp * parallel.cp * parallel.pp = 4")):
        validate_world(job, 6)


def test_cp_sits_inside_dp_unless_named() -> None:
    """Rank numbering (no processes needed for the arithmetic): tp innermost, then cp, dp, pp."""
    coords = []
    for rank in range(8):
        topo = Topology.__new__(Topology)
        # The grid arithmetic of Topology.__init__ without process groups.
        topo.sizes = {"tp": 2, "cp": 2, "ep": 1, "dp": 2, "pp": 1}
        order = rank_order(ParallelConfig(tp=2, cp=2, dp=2))
        assert order == ["tp", "cp", "dp", "pp"]
        topo.strides, stride = {}, 1
        for d in ["ep", *order]:
            topo.strides[d], stride = stride, stride * topo.sizes[d]
        topo.coords = {d: (rank // topo.strides[d]) % topo.sizes[d] for d in topo.sizes}
        topo.rank = rank
        coords.append((topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.dp_cp_ranks(), topo.next_cp_rank))
    assert [c[:3] for c in coords] == [(t, c, d) for d in range(2) for c in range(2) for t in range(2)]
    # The cp x dp group of rank 0 (tp rank 0): ranks 0, 2, 4, 6; the CP ring of rank 0 goes to rank 2.
    assert coords[0][3] == [0, 2, 4, 6] and coords[0][4] == 2
    assert rank_order(ParallelConfig(order="cp-tp-dp-pp")) == ["cp", "tp", "dp", "pp"]


@pytest.mark.parametrize("arch", ["gpt", "llama", "ernie"])
def test_packed_documents_equal_separate_runs(arch: str) -> None:
    """With model.document_separator, a packed sequence gives each document the logits it gets alone."""
    assert_packed_documents_equal_separate_runs(tiny_job(arch, seq_length=24).model)


def test_cp_attention_refuses_bad_shapes() -> None:
    """Shape errors are raised before any communication (no process group needed)."""
    split = ContextSplit(2, 0, None, 1, 1)
    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        ring_attention(q, k, k, split)
    with pytest.raises(ValueError, match="two equal chunks"):
        ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], split)
    with pytest.raises(ValueError, match="scatters 4 heads over 8 CP ranks"):
        all_to_all_attention(q, q, q, ContextSplit(8, 0, None, 1, 1))
    with pytest.raises(ValueError, match="make model.seq_length a multiple of 2 \\* parallel.cp"):
        split_sequence(torch.zeros(1, 6), 2, 0)
