"""The process grid: which global rank holds which (tp, cp, dp, pp) coordinate, and the groups along each
axis.

Context-parallel ranks (cp) split each sequence; they hold the same parameters as data-parallel replicas do,
so gradients are reduced, and ZeRO 1-3 shard, over the cp x dp group (`dp_cp_group`). Unless
parallel.order names cp, it sits just inside dp: with the default tp-dp-pp the numbering is tp-cp-dp-pp.

Expert parallelism (ep) is no axis of the grid: it is carved out of the tp x cp x dp ranks of one pipeline
stage (Megatron's expert grid with expert tensor parallelism 1: to the experts, CP and TP ranks are token
holders like DP replicas, each routing its own part of the micro-batches). Those ranks, numbered dp
innermost, then cp, then tp (index dp_rank + dp * (cp_rank + cp * tp_rank)), form the expert domain; each run
of ep consecutive domain ranks is an EP group holding all experts between them, and the domain ranks with the
same EP rank (the expert-data-parallel group, tp * cp * dp / ep ranks) hold the same experts and reduce
their gradients. So EP lies inside the DP ranks when ep divides dp, spans CP ranks when ep is dp times a
divisor of cp, and TP ranks when ep exceeds dp * cp.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.config.errors import ConfigError
from llmtrain.config.moe_rules import expert_layout_problem
from llmtrain.config.schema import ParallelConfig, TrainConfig
from llmtrain.config.validate import raise_if_problem, rank_order, resolve_dp
from llmtrain.parallel.watchdog import Watchdog

# Dimensions of the grid (ep is carved out of tp x cp x dp; see the module docstring).
DIMS = ("tp", "cp", "dp", "pp")
# How reports call a group spanning several dimensions (Megatron's names).
GROUP_NAMES = {("tp", "pp"): "mp", ("cp", "dp"): "dp+cp"}


class Topology:
    """Process groups of every parallel dimension, built once and passed explicitly to whoever needs them."""

    def __init__(
        self,
        parallel: ParallelConfig,
        world_size: int,
        rank: int,
        hang_timeout_s: float = TrainConfig.hang_timeout_s,
        report_dir: Path | None = None,
    ) -> None:
        """`hang_timeout_s` (train.hang_timeout_s) and `report_dir` (where hang reports go) configure the
        watchdog of this rank."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside a world of {world_size} processes")
        dp = resolve_dp(parallel, world_size)
        raise_if_problem(expert_layout_problem(parallel, dp))
        named = rank_order(parallel)
        self.parallel = parallel
        self.world_size = world_size
        self.rank = rank
        # What this rank waits on and the collectives it issued; the launcher starts its hang thread.
        self.watchdog = Watchdog(hang_timeout_s, rank, world_size, report_dir=report_dir)
        self.sizes: dict[str, int] = {
            "tp": parallel.tp,
            "cp": parallel.cp,
            "dp": dp,
            "pp": parallel.pp,
        }
        # Unnamed size-1 dimensions go innermost; they do not change the numbering of the named ones.
        self.order: list[str] = [d for d in DIMS if d not in named] + named
        self.strides: dict[str, int] = {}
        stride = 1
        for d in self.order:
            self.strides[d] = stride
            stride *= self.sizes[d]
        self.coords: dict[str, int] = {d: (rank // self.strides[d]) % self.sizes[d] for d in DIMS}
        self.ep = parallel.ep
        domain = self.coords["dp"] + dp * (self.coords["cp"] + parallel.cp * self.coords["tp"])
        self._ep_slot, self._ep_block = domain % self.ep, domain // self.ep
        # Process groups number their ranks in global order, which need not be the domain's (tp is
        # innermost by default): the EP rank (which experts) and expert-DP rank (which ZeRO-1 shard) are
        # positions in the sorted groups. Ranks of one expert-DP group get the same EP rank, as the
        # domain-to-global order is the same map in every EP group.
        self.ep_rank = self.ep_ranks().index(rank)
        self.expert_dp_rank = self.expert_dp_ranks().index(rank)
        # A one-process topology needs no groups, even inside a distributed job (reference runs in tests).
        self.distributed = world_size > 1
        if self.distributed and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Topology with world_size > 1 needs torch.distributed initialised; call "
                "llmtrain.parallel.init_distributed(job) first"
            )
        self._groups: dict[tuple[str, ...], Any] = {}
        if self.distributed:
            # llmtrain.parallel.comm numbers this process's collectives in this watchdog.
            self.watchdog.install()
            self.watchdog.name_group(None, "world")
            dims_list = [("tp",), ("dp",), ("pp",), ("tp", "pp")]
            if self.sizes["cp"] > 1:
                dims_list += [("cp",), ("cp", "dp")]
            for dims in dims_list:
                self._groups[dims] = self._new_groups(dims)
                self.watchdog.name_group(self._groups[dims], GROUP_NAMES.get(dims, "+".join(dims)))
            if self.ep > 1:
                self._expert_groups()

    @classmethod
    def single(cls) -> Topology:
        """One process: every degree 1 and no torch.distributed needed."""
        return cls(ParallelConfig(tp=1, pp=1, dp=1), 1, 0)

    def _new_groups(self, dims: tuple[str, ...]) -> Any:
        """Create the groups along `dims` (every rank joins every new_group call); return this rank's."""
        others = [d for d in DIMS if d not in dims]
        mine = None
        for fixed in itertools.product(*(range(self.sizes[d]) for d in others)):
            base = dict(zip(others, fixed, strict=True))
            ranks = sorted(
                self._rank_with(**base, **dict(zip(dims, free, strict=True)))
                for free in itertools.product(*(range(self.sizes[d]) for d in dims))
            )
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _domain_rank(self, index: int, **at: int) -> int:
        """Global rank of expert-domain index `index` (on this rank's pipeline stage, or `at`)."""
        cp = (index // self.dp) % self.cp
        return self._rank_with(dp=index % self.dp, cp=cp, tp=index // (self.dp * self.cp), **at)

    def ep_ranks(self, block: int | None = None, **at: int) -> list[int]:
        """Global ranks of this rank's EP group (or of domain block `block`: domain ranks [block * ep,
        (block + 1) * ep)), sorted (the group's rank order)."""
        k = self._ep_block if block is None else block
        return sorted(self._domain_rank(k * self.ep + e, **at) for e in range(self.ep))

    def expert_dp_ranks(self, slot: int | None = None, **at: int) -> list[int]:
        """Global ranks holding this rank's experts (or those at `slot` of every domain block): its
        expert-data-parallel group, sorted."""
        e = self._ep_slot if slot is None else slot
        return sorted(self._domain_rank(k * self.ep + e, **at) for k in range(self.expert_dp))

    expert_dp = property(lambda self: self.tp * self.cp * self.dp // self.ep)
    """Ranks holding the same experts: tp * cp * dp / ep."""

    def _expert_groups(self) -> None:
        """Create every EP and expert-DP group (every rank joins every new_group call, in the same order)."""
        for key, name, count, ranks_of in (
            (("ep",), "ep", self.expert_dp, self.ep_ranks),
            (("edp",), "expert-dp", self.ep, self.expert_dp_ranks),
        ):
            for pp, index in itertools.product(range(self.pp), range(count)):
                ranks = ranks_of(index, pp=pp)
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[key] = group
            self.watchdog.name_group(self._groups[key], name)

    ep_group = property(lambda self: self._groups.get(("ep",)))
    expert_dp_group = property(lambda self: self._groups.get(("edp",)))

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing ones default to this rank's own)."""
        given = {k.removesuffix("_rank"): v for k, v in coords.items()}
        unknown = set(given) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}; known: {', '.join(DIMS)}")
        for d, v in given.items():
            if not 0 <= v < self.sizes[d]:
                raise ValueError(f"{d}_rank={v} is outside 0..{self.sizes[d] - 1}")
        return self._rank_with(**given)

    def group(self, *dims: str) -> Any:
        """This rank's process group spanning `dims` (e.g. group("tp", "pp")); None when not distributed."""
        key = tuple(d for d in DIMS if d in dims)
        if not self.distributed:
            return None
        if key not in self._groups:
            self._groups[key] = self._new_groups(key)
            self.watchdog.name_group(self._groups[key], GROUP_NAMES.get(key, "+".join(key)))
        return self._groups[key]

    # Plain attributes of the contract, derived from the grid.
    tp = property(lambda self: self.sizes["tp"])
    cp = property(lambda self: self.sizes["cp"])
    pp = property(lambda self: self.sizes["pp"])
    dp = property(lambda self: self.sizes["dp"])
    tp_rank = property(lambda self: self.coords["tp"])
    cp_rank = property(lambda self: self.coords["cp"])
    pp_rank = property(lambda self: self.coords["pp"])
    dp_rank = property(lambda self: self.coords["dp"])
    tp_group = property(lambda self: self._groups.get(("tp",)))
    cp_group = property(lambda self: self._groups.get(("cp",)))
    pp_group = property(lambda self: self._groups.get(("pp",)))
    dp_group = property(lambda self: self._groups.get(("dp",)))
    dp_cp = property(lambda self: self.sizes["dp"] * self.sizes["cp"])
    """Ranks holding the same parameters (data-parallel replicas and context-parallel ranks)."""

    @property
    def dp_cp_group(self) -> Any:
        """The group gradients are reduced over: cp x dp (the dp group itself when cp is 1)."""
        return self._groups.get(("cp", "dp")) if self.cp > 1 else self.dp_group

    def dp_cp_ranks(self) -> list[int]:
        """Global ranks of this rank's cp x dp group, in the group's own rank order (sorted)."""
        return sorted(self._rank_with(cp=c, dp=d) for c in range(self.cp) for d in range(self.dp))

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in dp_cp_ranks(): which ZeRO-1 shard it owns."""
        return self.dp_cp_ranks().index(self.rank)

    @property
    def next_cp_rank(self) -> int:
        """Global rank of the next context-parallel rank on the ring (wrapping around)."""
        return self._rank_with(cp=(self.cp_rank + 1) % self.cp)

    @property
    def prev_cp_rank(self) -> int:
        """Global rank of the previous context-parallel rank on the ring (wrapping around)."""
        return self._rank_with(cp=(self.cp_rank - 1) % self.cp)

    mp_group = property(lambda self: self._groups.get(("tp", "pp")))
    is_first_stage = property(lambda self: self.coords["pp"] == 0)
    is_last_stage = property(lambda self: self.coords["pp"] == self.sizes["pp"] - 1)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its CUDA device (init_distributed sets it from LOCAL_RANK), else CPU."""
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping around, as interleaved schedules need)."""
        return self._rank_with(pp=(self.pp_rank + 1) % self.pp)

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping around)."""
        return self._rank_with(pp=(self.pp_rank - 1) % self.pp)

    def _rank_with(self, **coords: int) -> int:
        return sum({**self.coords, **coords}[d] * self.strides[d] for d in DIMS)

    def __repr__(self) -> str:
        dims = " ".join(f"{d}={self.sizes[d]}/{self.coords[d]}" for d in DIMS if self.sizes[d] > 1)
        if self.ep > 1:
            dims += f" ep={self.ep}/{self.ep_rank}"
        order = "-".join(d for d in self.order if d in ("tp", "dp", "pp") or self.sizes[d] > 1)
        return f"Topology(rank={self.rank}/{self.world_size} order={order} {dims or 'single'})"
