"""Search over parallel layouts for a fixed model, global batch and GPU count.

Dimensions: tp, pp, context parallelism (cp with ring or all-to-all attention; dp = gpus / (tp*cp*pp)),
expert parallelism (ep, MoE models: ep dividing the experts, carved out of tp x cp x dp as the trainer
allows: inside dp, spanning cp or tp), micro-batch size, schedule with its
virtual stages, recompute mode, sequence parallelism and the sharding of the model state: ZeRO stage 0-3,
hybrid sharding (zero 2/3 sharded inside a node, replicated across), the zero 2/3 gradients reduced every
micro-batch or once a step (parallel.grad_reduce) and CPU offload (zero 2/3). A layout fits
only when both its steady state and its startup peak fit (llmtrain.planner.cost.memory). Impossible values are
pruned up front with a reason each: the model's tensor-, pipeline- and context-parallel and mixture-of-experts
rules as config validation states them (llmtrain.config.validate), tp staying inside a node unless the
cluster allows otherwise, dp dividing the global batch, ... The remaining space is enumerated exhaustively
when small and searched by coordinate descent with restarts when large (AutoDDL style): a coarse screen of
every (tp, pp, cp, ep) picks the seeds, then each seed improves one dimension at a time (tp/pp jointly, and
cp, since dp follows) until no single change helps. Layouts that do not fit in memory score worse than any
that fit, ordered by how much they overflow, so descent walks towards fitting layouts.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from llmtrain.config.errors import ConfigError
from llmtrain.config.layout_rules import schedule_problem
from llmtrain.config.loader import parse_override
from llmtrain.config.schema import JobConfig
from llmtrain.config.validate import pipeline_problem, tensor_parallel_problem
from llmtrain.planner.cluster.hardware import Cluster, ClusterView
from llmtrain.planner.cost.layout import Layout, Software, Workload
from llmtrain.planner.cost.model import CostModel, Estimate

EXHAUSTIVE_LIMIT = 4000
"""Spaces up to this many layouts are enumerated; larger ones use coordinate descent."""
MAX_VIRTUAL_STAGES = 8
MAX_MICRO_BATCH = 64
MIN_CP_CHUNK = 1024
"""Tokens of each of the two chunks a context-parallel rank keeps, at least: smaller splits leave matmuls too
small to pay for the communication, so the search does not try them (--evaluate still can)."""
CP_COMMS = ("ring", "all_to_all")

# --evaluate keys -> Layout fields.
FIXABLE = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.dp": "dp",
    "parallel.cp": "cp",
    "parallel.cp_comm": "cp_comm",
    "parallel.ep": "ep",
    "parallel.virtual_stages": "virtual_stages",
    "parallel.schedule": "schedule",
    "parallel.sequence_parallel": "sequence_parallel",
    "parallel.zero_stage": "zero_stage",
    "parallel.dp_shard": "dp_shard",
    "parallel.offload": "offload",
    "parallel.grad_reduce": "grad_reduce",
    "train.micro_batch_size": "micro_batch",
    "model.recompute": "recompute",
}


def parse_fixed(text: str | Iterable[str] | None) -> dict[str, object]:
    """`"parallel.tp=8 parallel.pp=2"` (or a list of such items) -> {"tp": 8, "pp": 2}."""
    if not text:
        return {}
    items = text.split() if isinstance(text, str) else list(text)
    fixed: dict[str, object] = {}
    for item in items:
        key, value = parse_override(item)
        if key not in FIXABLE:
            raise ConfigError(f"--evaluate: {key} is not a planner setting; use one of {', '.join(FIXABLE)}")
        fixed[FIXABLE[key]] = value
    return fixed


Sharding = tuple[int, "int | None", str, str]
"""(zero stage, dp_shard or None for all of dp, offload, FSDP2's gradient reduction)."""
SHARDING_FIELDS = ("zero_stage", "dp_shard", "offload", "grad_reduce")


def _sharding_choices(
    dp: int, dp_per_node: int, software: Software, fixed: dict[str, object]
) -> list[Sharding]:
    """The (zero stage, dp_shard, offload, grad_reduce) combinations searched for `dp` replicas: every stage
    the software offers; at zero 2/3 hybrid sharding inside a node (the DP ranks of one node shard, nodes
    replicate: the gathers stay on NVLink), gradients reduced once a step instead of every micro-batch (less
    traffic, an unsharded gradient held) and CPU offload; settings fixed by --evaluate filter them."""
    choices: list[Sharding] = []
    for zero in software.zero_stages:
        choices.append((zero, None, "none", "microbatch"))
        if zero < 2:
            continue
        choices.append((zero, None, "none", "step"))
        if software.hybrid_sharding and 1 < dp_per_node < dp and dp % dp_per_node == 0:
            choices += [(zero, dp_per_node, "none", reduce) for reduce in ("microbatch", "step")]
        if software.offload:
            offloads = ["optimizer"] + (["optimizer+params"] if zero == 3 else [])
            choices += [(zero, None, offload, "microbatch") for offload in offloads]
    wanted = {key: fixed[key] for key in SHARDING_FIELDS if key in fixed}
    if wanted:
        choices = [
            c for c in choices if all(c[SHARDING_FIELDS.index(k)] == v for k, v in wanted.items())
        ] or [
            (
                int(wanted.get("zero_stage", 0)),
                wanted.get("dp_shard"),
                str(wanted.get("offload", "none")),
                str(wanted.get("grad_reduce", "microbatch")),
            )
        ]
    if dp == 1:
        choices = [c for c in choices if c[0] == 0] or choices
    return choices


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Space:
    """Candidate values per dimension after pruning, and why the others were dropped."""

    tp_pp: list[tuple[int, int]]
    contexts: dict[tuple[int, int], list[tuple[int, str]]]
    """Per (tp, pp), the (cp, cp_comm) choices whose dp divides the GPUs and the global batch."""
    experts: list[int]
    """Expert-parallel degrees (1 for a dense model)."""
    micro_batches: dict[int, list[int]]
    """Per dp, the allowed micro-batch sizes."""
    schedules: list[tuple[str, int]]
    recompute: list[str]
    sequence_parallel: list[bool]
    sharding: dict[int, list[Sharding]]
    """Per dp, the allowed (zero stage, dp_shard, offload, grad_reduce) combinations."""
    gpus: int
    pruned: Counter = field(default_factory=Counter)

    def layouts(self, model: CostModel) -> Iterable[Layout]:
        """Every combination, skipping invalid ones (counted in `pruned`)."""
        for tp, pp, cp, comm, ep in self.grid():
            dp = model.c.devices // (tp * pp * cp)
            for mb, (sched, v), rc, sp, (zero, shard, offload, reduce) in itertools.product(
                self.micro_batches[dp],
                self.schedules,
                self.recompute,
                self.sequence_parallel,
                self.sharding[dp],
            ):
                layout = Layout(
                    tp, pp, dp, mb, v, sched, rc, sp, zero, shard, offload, cp=cp, cp_comm=comm, ep=ep,
                    grad_reduce=reduce,
                )  # fmt: skip
                why = model.invalid_reason(layout)
                if why:
                    self.pruned[why] += 1
                    continue
                yield layout

    def grid(self) -> Iterable[tuple[int, int, int, str, int]]:
        """Every (tp, pp, cp, cp_comm, ep) of the space."""
        for tp, pp in self.tp_pp:
            for (cp, comm), ep in itertools.product(self.contexts[(tp, pp)], self.experts):
                yield tp, pp, cp, comm, ep

    def size(self) -> int:
        """Number of combinations before the per-layout validity check."""
        per = len(self.schedules) * len(self.recompute) * len(self.sequence_parallel)
        return per * sum(
            len(self.micro_batches[dp]) * len(self.sharding[dp])
            for dp in (self.gpus // (tp * pp * cp) for tp, pp, cp, _, _ in self.grid())
        )


def build_space(model: CostModel, fixed: dict[str, object] | None = None) -> Space:
    """Candidate values for every dimension, with pruning reasons."""
    fixed = dict(fixed or {})
    m, w, view = model.w.model, model.w, model.c
    gpus = view.devices
    pruned: Counter = Counter()

    def pick(name: str, values: list) -> list:
        if name in fixed:
            value = fixed[name]
            return [value]
        return values

    tps = []
    for tp in pick("tp", _divisors(gpus)):
        # Sequence parallelism is a dimension of its own; its rule is checked per layout (invalid_reason).
        reason = f"tp={tp} does not divide {gpus} GPUs" if gpus % tp else tensor_parallel_problem(m, tp)
        if not reason and tp > view.devices_per_node and not view.cross_node_tp and "tp" not in fixed:
            reason = f"tp={tp} would span nodes of {view.devices_per_node} devices (cross_node_tp: false)"
        if reason:
            pruned[reason] += 1
        else:
            tps.append(tp)
    cps = []
    for cp in pick("cp", [c for c in _divisors(gpus) if c == 1 or w.seq >= 2 * c * MIN_CP_CHUNK]):
        # The model's rules for cp (seq_length a multiple of 2cp, heads for all_to_all, ...) are checked per
        # layout (invalid_reason), as they depend on tp and sequence parallelism.
        comms = pick("cp_comm", list(CP_COMMS)) if cp > 1 else [str(fixed.get("cp_comm", "ring"))]
        cps += [(cp, comm) for comm in comms]
    experts = pick("ep", _divisors(m.num_experts) if m.is_moe else [1])
    tp_pp = []
    contexts: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for tp in tps:
        for pp in pick("pp", _divisors(gpus // tp) if gpus % tp == 0 else []):
            reason = ""
            if (gpus // tp) % pp:
                reason = f"tp*pp={tp * pp} does not divide {gpus} GPUs"
            elif split := pipeline_problem(m.num_layers, pp):
                reason = split
            if reason:
                pruned[reason] += 1
                continue
            ok = []
            for cp, comm in cps:
                dp = gpus // (tp * pp * cp)
                if (gpus // (tp * pp)) % cp:
                    reason = f"tp*cp*pp={tp * cp * pp} does not divide {gpus} GPUs"
                elif "dp" in fixed and fixed["dp"] != dp:
                    reason = f"dp fixed to {fixed['dp']} but {gpus} GPUs / (tp*cp*pp={tp * cp * pp}) = {dp}"
                elif w.global_batch % dp:
                    reason = f"dp={dp} does not divide global batch {w.global_batch}"
                else:
                    ok.append((cp, comm))
                    continue
                pruned[reason] += 1
            if ok:
                tp_pp.append((tp, pp))
                contexts[(tp, pp)] = ok
    if not tp_pp:
        detail = "; ".join(f"{k}" for k in list(pruned)[:5])
        raise ConfigError(f"no (tp, pp) layout is possible for {gpus} GPUs: {detail}")
    micro = {}
    for dp in sorted({gpus // (tp * pp * cp) for (tp, pp), ctx in contexts.items() for cp, _ in ctx}):
        per_replica = w.global_batch // dp
        allowed = [b for b in _divisors(per_replica) if b <= MAX_MICRO_BATCH]
        micro[dp] = pick("micro_batch", allowed)
        if "micro_batch" in fixed and per_replica % int(fixed["micro_batch"]):
            raise ConfigError(
                f"train.micro_batch_size={fixed['micro_batch']} does not divide "
                f"global_batch/dp = {per_replica}"
            )
    max_pp = max(pp for _, pp in tp_pp)
    schedules = [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1)]
    schedules += [("interleaved_1f1b", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if 2 * v <= m.num_layers]
    # The zero-bubble schedules of two chunks per rank (issue 35): the V-shaped ones and interleaved ZB.
    if 4 <= m.num_layers:
        schedules += [("zb_v", 2), ("dualpipe_v", 2), ("interleaved_zb", 2)]
    if "schedule" in fixed:
        schedules = [(s, v) for s, v in schedules if s == fixed["schedule"]] or [(str(fixed["schedule"]), 1)]
    if "virtual_stages" in fixed:
        vv = int(fixed["virtual_stages"])  # type: ignore[arg-type]
        schedules = [
            (s, vv) for s in dict.fromkeys(s for s, _ in schedules) if not schedule_problem(s, 2, vv)
        ]
    if max_pp == 1 and "schedule" not in fixed:
        schedules = [("1f1b", 1)]
    inner = {gpus // (tp * pp * cp): tp * cp for (tp, pp), ctx in contexts.items() for cp, _ in ctx}
    sharding = {
        dp: _sharding_choices(dp, view.devices_per_node // ranks, model.sw, fixed)
        for dp, ranks in inner.items()
    }
    return Space(
        tp_pp=tp_pp,
        contexts=contexts,
        experts=experts,
        micro_batches=micro,
        schedules=schedules,
        recompute=pick("recompute", ["none", "selective", "full"]),
        sequence_parallel=pick("sequence_parallel", [False, True]),
        sharding=sharding,
        gpus=gpus,
        pruned=pruned,
    )


OFFLOAD_RANK = 1e6
"""Added to the score of a fitting layout that offloads: offload is the fallback for state that does not fit
on the device, not a speed-up (its host Adam and transfer times are the model's least validated part)."""


def score(est: Estimate) -> float:
    """Lower is better: step time for fitting layouts, those that offload after those that do not; above
    every fitting one, memory overflow otherwise."""
    if est.fits:
        return est.step_time + (OFFLOAD_RANK if est.layout.offload != "none" else 0.0)
    return 1e9 * est.memory["total"] / est.capacity


@dataclass
class PlanResult:
    """Ranked estimates (best first) and how the search went."""

    ranked: list[Estimate]
    evaluated: int
    method: str
    seconds: float
    pruned: Counter
    workload: Workload
    cluster_name: str
    gpus: int

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def fitting(self) -> list[Estimate]:
        """The estimates that fit in memory."""
        return [e for e in self.ranked if e.fits]


class Searcher:
    """Evaluates layouts with caching; exhaustive or coordinate-descent search over a Space."""

    def __init__(self, model: CostModel, space: Space) -> None:
        self.model = model
        self.space = space
        self.cache: dict[Layout, Estimate] = {}
        self.rejected: Counter = Counter()
        """Why layouts that descent proposed could not run (the enumeration counts them in space.pruned)."""

    def canonical(self, layout: Layout) -> Layout:
        """`layout`, reducing every micro-batch where it reduces once a step over a step of one micro-batch
        (the same run: evaluated and ranked once)."""
        if layout.grad_reduce == "step" and self.model.w.global_batch == layout.dp * layout.micro_batch:
            return replace(layout, grad_reduce="microbatch")
        return layout

    def eval(self, layout: Layout) -> Estimate | None:
        layout = self.canonical(layout)
        if layout in self.cache:
            return self.cache[layout]
        if why := self.model.invalid_reason(layout):
            self.rejected[why] += 1
            return None  # descent proposes combinations freely
        est = self.model.evaluate(layout)
        self.cache[layout] = est
        return est

    def exhaustive(self) -> None:
        for layout in self.space.layouts(self.model):
            self.eval(layout)

    def _moved(self, cur: Layout, tp: int, pp: int, cp: int, comm: str) -> Layout:
        """`cur` on another (tp, pp, cp) grid point: dp follows, the micro-batch is the nearest allowed."""
        dp = self.model.c.devices // (tp * pp * cp)
        mb = min(self.space.micro_batches[dp], key=lambda b: (abs(b - cur.micro_batch), b))
        return replace(cur, tp=tp, pp=pp, dp=dp, micro_batch=mb, cp=cp, cp_comm=comm)

    def _neighbours(self, cur: Layout, dim: str) -> list[Layout]:
        s = self.space
        if dim == "tp_pp":
            out = []
            for tp, pp in s.tp_pp:
                contexts = s.contexts[(tp, pp)]
                cp, comm = (cur.cp, cur.cp_comm) if (cur.cp, cur.cp_comm) in contexts else contexts[0]
                out.append(self._moved(cur, tp, pp, cp, comm))
            return out
        if dim == "context":
            return [self._moved(cur, cur.tp, cur.pp, cp, comm) for cp, comm in s.contexts[(cur.tp, cur.pp)]]
        if dim == "ep":
            return [replace(cur, ep=ep) for ep in s.experts]
        if dim == "micro_batch":
            return [replace(cur, micro_batch=b) for b in s.micro_batches[cur.dp]]
        if dim == "schedule":
            return [replace(cur, schedule=sc, virtual_stages=v) for sc, v in s.schedules]
        if dim == "recompute":
            return [replace(cur, recompute=r) for r in s.recompute]
        if dim == "sequence_parallel":
            return [replace(cur, sequence_parallel=x) for x in s.sequence_parallel]
        return [
            replace(cur, zero_stage=z, dp_shard=d, offload=o, grad_reduce=r)
            for z, d, o, r in s.sharding[cur.dp]
        ]

    def _best_of(self, layouts: Iterable[Layout]) -> Layout | None:
        best, best_score = None, float("inf")
        for layout in map(self.canonical, layouts):
            est = self.eval(layout)
            if est is not None and score(est) < best_score:
                best, best_score = layout, score(est)
        return best

    def coordinate_descent(self, seeds: int = 8) -> None:
        s, gpus = self.space, self.model.c.devices
        dims = (
            "tp_pp", "context", "ep", "micro_batch", "schedule", "recompute", "sequence_parallel", "sharding",
        )  # fmt: skip
        # Screen every (tp, pp, cp, ep) with the settings that usually fit and rarely lose much.
        starts = []
        for tp, pp, cp, comm, ep in s.grid():
            dp = gpus // (tp * pp * cp)
            base = Layout(
                tp,
                pp,
                dp,
                s.micro_batches[dp][0],
                s.schedules[0][1],
                s.schedules[0][0],
                "full" if "full" in s.recompute else s.recompute[0],
                (tp > 1) if (tp > 1) in s.sequence_parallel else s.sequence_parallel[0],
                cp=cp,
                cp_comm=comm,
                ep=ep,
            )
            # The most sharded state without offload first: the likeliest to fit.
            candidates = [
                replace(base, zero_stage=z, dp_shard=d, offload=o, grad_reduce=r, recompute=rc)
                for z, d, o, r in s.sharding[dp]
                for rc in dict.fromkeys((base.recompute, s.recompute[0]))
            ]
            best = self._best_of(candidates)
            if best is not None:
                starts.append(best)
        starts.sort(key=lambda lay: score(self.cache[lay]))
        for start in starts[:seeds]:
            cur = start
            improved = True
            while improved:
                improved = False
                for dim in dims:
                    cand = self._best_of(self._neighbours(cur, dim))
                    if cand is not None and score(self.cache[cand]) < score(self.cache[cur]):
                        cur, improved = cand, True


def plan(
    workload: Workload,
    cluster: Cluster | ClusterView,
    gpus: int,
    fixed: dict[str, object] | None = None,
    software: Software | None = None,
    top: int = 10,
    method: str = "auto",
    simulate_top: bool = True,
) -> PlanResult:
    """Search the best layouts of `workload` on `gpus` devices of `cluster`; best first (fitting first)."""
    start = time.perf_counter()
    view = cluster.view(gpus) if isinstance(cluster, Cluster) else cluster
    if view.devices != gpus:
        raise ConfigError(f"cluster view has {view.devices} devices but {gpus} were requested")
    model = CostModel(workload, view, software)
    space = build_space(model, fixed)
    searcher = Searcher(model, space)
    if method not in ("auto", "exhaustive", "coordinate"):
        raise ConfigError(f"search method must be auto, exhaustive or coordinate; got {method!r}")
    size = space.size()
    if method == "exhaustive" or (method == "auto" and size <= EXHAUSTIVE_LIMIT):
        searcher.exhaustive()
        used = "exhaustive"
    else:
        searcher.coordinate_descent()
        used = "coordinate-descent"
    if not searcher.cache:
        reasons = "; ".join(f"{k} (x{n})" for k, n in (space.pruned + searcher.rejected).most_common(4))
        raise ConfigError(
            f"no valid layout for {gpus} GPUs and global batch {workload.global_batch}: {reasons}"
        )
    ranked = sorted(searcher.cache.values(), key=score)
    if simulate_top:
        # Re-time the leaders with the pipeline simulator where the shape is small enough to replay.
        head = [model.evaluate(e.layout, use_simulator=True) for e in ranked[:top]]
        ranked = sorted(head, key=score) + ranked[top:]
    return PlanResult(
        ranked=ranked,
        evaluated=len(searcher.cache),
        method=used,
        seconds=time.perf_counter() - start,
        pruned=space.pruned,
        workload=workload,
        cluster_name=view.device.name,
        gpus=gpus,
    )


def plan_job(
    job: JobConfig,
    cluster: Cluster | ClusterView,
    gpus: int,
    global_batch: int | None = None,
    fixed: dict[str, object] | None = None,
    software: Software | None = None,
    top: int = 10,
) -> PlanResult:
    """`plan` for a JobConfig (model, precision, bucket size; global batch from the job unless given)."""
    return plan(Workload.from_job(job, global_batch), cluster, gpus, fixed, software, top)
