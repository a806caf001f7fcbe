"""Sharded construction on the meta device: every rank allocates and initialises only its own slices, and
the slices of all ranks put together are the single-process model (`models.build`), bit for bit.

Reference: `models.build(cfg, seed)` on one process. Each rank's tensors are placed by the checkpoint
layout (describe_model) into full tensors that start as NaN, so a region no rank holds, or two replicas
that disagree, fails the comparison. At zero_stage 3 a rank's tensors are its FSDP2 shards of its TP slices.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmtrain import models
from llmtrain.config import JobConfig
from llmtrain.models import init
from llmtrain.parallel import Topology, apply_data_parallel, apply_tp, materialize, parallelize
from llmtrain.parallel.fsdp import local_tensor
from llmtrain.parallel.materialize import fill_local
from llmtrain.parallel.param_layout import ParamLayout, describe_model
from llmtrain.pipeline.executor import build_pipeline
from llmtrain.pipeline.stages import build_stages
from tests.parallel._dist import SpawnedCases, tiny_job

# 3 rows of 64 per block in the tiny models: blocks straddle the TP and ZeRO boundaries (64-row vocab
# shards, 32-column o_proj shards), so partial blocks are drawn and cut.
SMALL_BLOCK = 200
# The library's block, read before any test or worker changes init.BLOCK_NUMEL.
DEFAULT_BLOCK = init.BLOCK_NUMEL


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the non-meta storages created by tensor operations while active (alive at once).

    An operation on DTensors reaches this mode once, with DTensor results (the operations on their local
    tensors run below it), so a DTensor result counts as the storage of its local tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                # A DTensor's own storage is a placeholder of the logical size: its local shard is the memory.
                storage = local_tensor(t).untyped_storage()
                if id(storage) not in self.tracked:
                    self.tracked.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out


def _pieces(model: nn.Module, topo: Any, job: JobConfig) -> dict[str, tuple[tuple[int, ...], list]]:
    """This rank's tensors as {single-process name: (full shape, [(offsets, values), ...])}."""
    return {
        name: (
            m.layout.global_shape,
            [(p.offsets, p.tensor.clone()) for p in m.pieces(m.tensor.detach())],
        )
        for name, m in describe_model(model, topo, job.model.tied_embeddings).items()
    }


def _unique_bytes(model: nn.Module) -> int:
    """Bytes of the parameters as tensors (an FSDP-sharded one counts whole: its TP-local size)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the storage this rank's parameters live in (FSDP: its padded shards)."""
    storages = {}
    for p in model.parameters():
        storage = local_tensor(p).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _largest_shard_bytes(model: nn.Module) -> int:
    """Bytes of the largest FSDP2 shard (padded) of `model`; 0 without FSDP. FSDP2's allocation of meta
    shards (``to_empty``) holds one shard twice at a time: a tied weight is allocated once per module that
    owns it, the first copy freed after the second; an uneven shard is copied into a padded buffer."""
    sharded = [local_tensor(p) for p in model.parameters() if isinstance(p, DTensor)]
    return max((t.untyped_storage().nbytes() for t in sharded), default=0)


def _construct(rank: int, world: int, job: JobConfig, block_numel: int) -> dict[str, Any]:
    """On one rank: (a) meta model -> apply_tp -> build_stages -> [FSDP2 at zero_stage 2/3] -> materialize
    under a live-bytes counter; (b) the trainer's path (parallelize, then build_pipeline with pp > 1, data
    parallelism included)."""
    init.BLOCK_NUMEL = block_numel
    topo = Topology(job.parallel, world, rank)
    seed = job.train.seed
    with LiveBytes() as live:
        model: nn.Module = models.empty_model(job.model, device="meta")
        apply_tp(model, topo, job.parallel.sequence_parallel, seed)
        if topo.pp > 1:
            model = build_stages(model, topo, job.parallel.virtual_stages)
        if job.parallel.zero_stage >= 2:
            apply_data_parallel(model, topo, job)
        materialize(model, topo, job.model, seed, "cpu")
    with LiveBytes() as trainer_live:
        trainer_model = parallelize(models.empty_model(job.model, device="meta"), topo, job)
        if topo.pp > 1:
            trainer_model, _ = build_pipeline(trainer_model, topo, job)
    return {
        "pieces": _pieces(model, topo, job),
        "trainer_pieces": _pieces(trainer_model, topo, job),
        "peak": live.peak,
        # GradBuffers (zero_stage 0/1) copy the parameters into flat buffers: only FSDP2's is bounded here.
        "trainer_peak": trainer_live.peak,
        "local_bytes": _held_bytes(model),
        "tp_local_bytes": _unique_bytes(model),
        "largest_shard_bytes": _largest_shard_bytes(model),
    }


def _assemble(ranks: list[dict[str, tuple[tuple[int, ...], list]]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's pieces; replicas must agree, and every element must be covered."""
    full: dict[str, torch.Tensor] = {}
    for pieces in ranks:
        for name, (shape, parts) in pieces.items():
            target = full.setdefault(name, torch.full(shape, math.nan))
            for offsets, values in parts:
                region = target[tuple(slice(o, o + s) for o, s in zip(offsets, values.shape, strict=True))]
                held = ~region.isnan()
                assert torch.equal(region[held], values[held]), f"{name}: two ranks hold different values"
                region.copy_(values)
    for name, t in full.items():
        assert not t.isnan().any(), f"{name}: {int(t.isnan().sum())} elements held by no rank"
    return full


def _largest_block_bytes(model: nn.Module) -> int:
    """fp32 bytes of the largest row block any normal-initialised parameter draws at once."""
    kinds = models.init_kinds(model)
    return max(
        min(math.prod(p.shape), init.rows_per_block(p.shape) * math.prod(p.shape[1:])) * 4
        for p in model.parameters()
        if kinds[id(p)] == "normal"
    )


# (arch, world, overrides); dp is what the other degrees leave of the world. Every layout runs on 4 ranks, so
# all share one gloo group (a group of 2 besides would start two more processes, ~6 CPU-s each for torch and
# DTensor): tp=2 and the pipelines of 2 stages below then hold two data-parallel replicas, which must build
# the same shards (_assemble checks that replicas agree) as well as the single-process model's.
LAYOUTS = {
    "gpt-tp2": ("gpt", 4, dict(tp=2)),
    "llama-pp2-tied": ("llama", 4, dict(pp=2, tie_word_embeddings=True)),
    "llama-tp2-pp2-tied-sp": ("llama", 4, dict(tp=2, pp=2, tie_word_embeddings=True, sequence_parallel=True)),
    "ernie-pp2-virtual2": (
        "ernie",
        4,
        dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_layers=4),
    ),
    "llama-tp4-kv2": ("llama", 4, dict(tp=4)),
    "gpt-zero3-dp4": ("gpt", 4, dict(zero_stage=3)),
    "llama-zero3-tp2-dp2": ("llama", 4, dict(tp=2, zero_stage=3)),
    "llama-zero3-pp2-dp2-virtual2-tied": (
        "llama",
        4,
        dict(
            pp=2,
            virtual_stages=2,
            schedule="interleaved_1f1b",
            num_layers=4,
            tie_word_embeddings=True,
            zero_stage=3,
        ),
    ),
    "llama-zero3-hybrid-dp_shard2": ("llama", 4, dict(zero_stage=3, dp_shard=2)),
    # 130 vocabulary rows over 4 shards: 33, 33, 33, 31; 5 learned positions: 2, 2, 1 and an empty shard.
    "gpt-zero3-dp4-uneven": ("gpt", 4, dict(zero_stage=3, vocab_size=130, seq_length=5)),
}


def _layout_job(layout: str) -> JobConfig:
    arch, _, overrides = LAYOUTS[layout]
    job = tiny_job(arch, **overrides)
    job.train.seed = 4321
    return job


def _block(layout: str) -> int:
    # The default block (64K elements) is larger than these tensors; the small one makes blocks straddle
    # shard boundaries. One layout keeps the default, drawing each tensor in one block.
    return DEFAULT_BLOCK if layout == "gpt-tp2" else SMALL_BLOCK


@pytest.fixture(scope="module")
def constructed() -> SpawnedCases:
    """Each rank's _construct results per layout, one gloo group per world size (each layout builds its own
    Topology in it)."""
    return SpawnedCases(
        _construct,
        {name: (world, (_layout_job(name), _block(name))) for name, (_, world, _) in LAYOUTS.items()},
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shards_of_every_rank_are_the_single_process_model(
    layout: str, constructed: SpawnedCases, monkeypatch: Any
) -> None:
    job = _layout_job(layout)
    monkeypatch.setattr(init, "BLOCK_NUMEL", _block(layout))
    reference = models.build(job.model, seed=job.train.seed)
    want = dict(reference.named_parameters())
    full_bytes = _unique_bytes(reference)

    results = constructed(layout)
    for key in ("pieces", "trainer_pieces"):
        got = _assemble([r[key] for r in results])
        assert set(got) == set(want), key
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{key}: {name} differs from the single-process model"

    # Memory: a rank's peak is its own tensors plus one row block, or at zero_stage 3 one shard twice
    # (_largest_shard_bytes); that bound is below the full model, and at zero_stage 3 below this rank's
    # TP-local model, so building either on any rank would fail here.
    for rank, r in enumerate(results):
        bound_slack = max(_largest_block_bytes(reference), r["largest_shard_bytes"])
        ceiling = r["tp_local_bytes"] if job.parallel.zero_stage >= 2 else full_bytes
        assert r["local_bytes"] + bound_slack < ceiling, "the layout is too small to tell"
        assert r["peak"] <= r["local_bytes"] + bound_slack, (
            f"rank {rank} held {r['peak']} bytes at once; its parameters are {r['local_bytes']} "
            f"(+ {bound_slack}), its TP-local model {r['tp_local_bytes']}, the full model {full_bytes}"
        )
        if job.parallel.zero_stage >= 2:
            assert r["trainer_peak"] <= r["local_bytes"] + bound_slack, (
                f"rank {rank}: the trainer's construction held {r['trainer_peak']} bytes at once"
            )


def test_a_tensor_starts_the_same_whatever_else_is_built() -> None:
    """Layer 3 materialised alone (no embedding, no other layer) equals layer 3 of the whole model."""
    job = tiny_job("llama", num_layers=4)
    whole = models.build(job.model, seed=11)
    alone = nn.ModuleDict(
        {"layers": nn.ModuleDict({"3": models.empty_model(job.model, device="meta").layers[3]})}
    )
    materialize(alone, Topology.single(), job.model, 11, "cpu")
    got = dict(alone.named_parameters())
    want = {f"layers.3.{n}": p for n, p in whole.layers[3].named_parameters()}
    assert set(got) == set(want)
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def test_meta_model_materialised_in_one_process_keeps_ties_and_attributes() -> None:
    job = tiny_job("gpt")
    model = models.empty_model(job.model, device="meta")
    model.layers[0].attn.q_proj.weight.marker = "kept"
    materialize(model, Topology.single(), job.model, 5, "cpu")
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].attn.q_proj.weight.marker == "kept"
    reference = models.build(job.model, seed=5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_flat_shards_of_a_tp_local_tensor_fill_like_the_whole(monkeypatch: Any) -> None:
    """ZeRO-3's view: flat ranges (cut mid-row) of TP rank 1's gate_up slice, each filled alone, put back
    together are that slice of the full tensor."""
    monkeypatch.setattr(init, "BLOCK_NUMEL", SMALL_BLOCK)
    ffn, hidden = 96, 64
    whole = torch.empty(2 * ffn, hidden)
    models.fill_region(whole, "w", "normal", whole.shape, (0, 0), seed=9, std=0.02)
    layout = ParamLayout.split(whole.shape, 0, [(48, 48), (ffn + 48, 48)])
    local = torch.cat([whole[48:96], whole[ffn + 48 :]]).flatten()
    cuts = [0, 1000, 1001, 4000, local.numel()]
    shards = []
    for start, stop in zip(cuts, cuts[1:], strict=False):
        shard = torch.empty(stop - start)
        fill_local(shard, "w", "normal", layout, 9, 0.02, flat_start=start)
        shards.append(shard)
    assert torch.equal(torch.cat(shards), local)


def test_meta_buffer_is_refused() -> None:
    job = tiny_job("gpt")
    model = models.empty_model(job.model, device="meta")
    model.register_buffer("table", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="table is a meta buffer"):
        materialize(model, Topology.single(), job.model, 5, "cpu")
