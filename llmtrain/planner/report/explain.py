"""Why the planner chose a layout: its step time and memory split, and what ruled out the runners-up.

The chosen layout's step time splits into parts that sum to it (Estimate's busiest-rank terms):
compute without recomputation, recomputation, exposed TP collectives, exposed context-parallel traffic,
expert-parallel all-to-alls, exposed pipeline sends, pipeline fill/drain (bubble), exposed
data-parallel/ZeRO communication and the optimizer step. Each runner-up (the best layout of every other
(tp, pp, cp, ep, zero, recompute) family, best first) gets one line from its Estimate's
differences to the choice: what does not fit and which memory row grew most, or which parts cost more.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.planner.cluster.hardware import ClusterView
from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost.layout import GIB, Layout
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.report.tables import format_memory
from llmtrain.planner.search.uniform import PlanResult

PART_LABELS = {
    "compute": "compute",
    "recompute": "recompute",
    "tp": "TP comm exposed",
    "cp": "CP comm exposed",
    "ep": "EP all-to-all",
    "p2p": "PP p2p exposed",
    "bubble": "bubble",
    "dp": "DP/ZeRO comm exposed",
    "optimizer": "optimizer",
}
"""The step-time parts in the order they print."""
MEMORY_ROWS = ("params", "grads", "optimizer", "activations", "gathered", "buffers")
SHARE_SHOWN = 0.1
"""A runner-up's line names the parts that add at least this share of its extra time."""


def time_parts(est: Estimate) -> dict[str, float]:
    """The step time of `est` split into PART_LABELS' parts (seconds; they sum to est.step_time)."""
    return {
        "compute": est.compute - est.recompute,
        "recompute": est.recompute,
        "tp": est.tp_comm,
        "cp": est.cp_comm,
        "ep": est.ep_comm,
        "p2p": est.pp_p2p,
        "bubble": est.pp_bubble - est.pp_p2p,
        "dp": est.dp_exposed,
        "optimizer": est.optimizer,
    }


def part_kinds(layout: Layout, view: ClusterView, float8_gather: bool = False) -> dict[str, str]:
    """What each communication part is, for this layout: collective kinds and the links they cross;
    ``float8_gather``: ZeRO-3's parameter gathers carry the float8 linears' weights in float8."""
    link = lambda size, stride=1: "across nodes" if view.spans_nodes(size, stride) else "inside a node"  # noqa: E731
    tp = "all-gather + reduce-scatter (SP)" if layout.sequence_parallel else "all-reduce"
    dp = {
        0: "gradient all-reduce",
        1: "gradient reduce-scatter + parameter all-gather",
        2: "gradient reduce-scatter + parameter gathers per micro-batch",
        3: "gradient reduce-scatter + parameter gathers per micro-batch, forward and backward",
    }[layout.zero_stage]
    if float8_gather:
        dp += " (block linears' weights in float8: 1 byte each)"
    if layout.offload != "none":
        dp += ", host transfers"
    cp = "ring K/V sends" if layout.cp_comm == "ring" else "q/k/v/output all-to-alls"
    ep_stride = C.expert_group_strides(layout.tp, layout.cp, layout.dp, layout.ep, view.devices_per_node)[0]
    return {
        "tp": f"TP {tp} {link(layout.tp)}" if layout.tp > 1 else "",
        "cp": f"CP {cp} {link(layout.cp, layout.tp)}" if layout.cp > 1 else "",
        "ep": f"EP dispatch + combine {link(layout.ep, ep_stride)}" if layout.ep > 1 else "",
        "p2p": f"PP sends {link(layout.pp, layout.tp * layout.cp * layout.dp)}" if layout.pp > 1 else "",
        "dp": f"DP {dp} {link(layout.dp * layout.cp, layout.tp)}" if layout.dp * layout.cp > 1 else "",
        "bubble": f"{layout.schedule} fill and drain" if layout.pp > 1 else "",
        "recompute": f"recompute {layout.recompute}" if not layout.layer_recompute else "per-layer recompute",
    }


def why_not(est: Estimate, chosen: Estimate, view: ClusterView) -> str:
    """What rules `est` out against `chosen`, from their Estimates' differences."""
    if not est.fits:
        grew = {k: est.memory[k] - chosen.memory[k] for k in MEMORY_ROWS}
        row = max(grew, key=lambda k: (grew[k], est.memory[k]))
        over = f"does not fit: {est.memory['total'] / GIB:.1f}/{est.capacity / GIB:g} GiB"
        if est.step_time < chosen.step_time:
            over += f" though {est.step_time - chosen.step_time:+.3f} s"
        if est.memory["startup"] > est.memory["steady"]:
            return over + f" (startup peak; steady state {est.memory['steady'] / GIB:.1f} GiB)"
        return over + f" ({row} {est.memory[row] / GIB:.1f} GiB, {grew[row] / GIB:+.1f} vs chosen)"
    if est.layout.offload != "none" and chosen.layout.offload == "none":
        return f"offloads to the host (ranked after every on-device layout); {est.step_time:.3f} s"
    mine, theirs = time_parts(est), time_parts(chosen)
    extra = est.step_time - chosen.step_time
    if extra <= 0:
        return f"{extra:+.3f} s: as fast (ranked after it on ties)"
    kinds = part_kinds(est.layout, view, est.float8_gather)
    deltas = sorted(((mine[k] - theirs[k], k) for k in PART_LABELS), reverse=True)
    named = [
        f"{d:+.3f} s {kinds.get(k) or PART_LABELS[k]}"
        for d, k in deltas
        if d > 0 and d >= SHARE_SHOWN * extra
    ]
    saved = [f"{d:+.3f} s {PART_LABELS[k]}" for d, k in deltas if d < 0 and -d >= SHARE_SHOWN * extra]
    return f"{extra:+.3f} s: " + ", ".join(named) + (f" (offset by {', '.join(saved)})" if saved else "")


@dataclass
class Explanation:
    """The chosen estimate, its time split, and the runners-up each with the reason it lost."""

    chosen: Estimate
    parts: dict[str, float]
    kinds: dict[str, str]
    runners_up: list[tuple[Estimate, str]]
    schedules: list[tuple[Estimate, str]] = field(default_factory=list)
    """The chosen layout under the other pipeline schedules evaluated, each with its bubble and memory
    against the choice (empty without pipeline parallelism)."""

    def as_dict(self) -> dict:
        """JSON-ready: layout, time parts (seconds), memory rows (GiB), runners-up with their reasons."""
        c = self.chosen
        return {
            "layout": c.layout.short(),
            "step_time_s": c.step_time,
            "time_s": self.parts,
            "time_kinds": {k: v for k, v in self.kinds.items() if v},
            "memory_gb": {k: v / GIB for k, v in c.memory.items()},
            "fits": c.fits,
            "runners_up": [
                {"layout": e.layout.short(), "step_time_s": e.step_time, "fits": e.fits, "why_not": why}
                for e, why in self.runners_up
            ],
            "schedules": [
                {
                    "layout": e.layout.short(),
                    "step_time_s": e.step_time,
                    "fits": e.fits,
                    "against_chosen": why,
                }
                for e, why in self.schedules
            ],
        }


def _family(layout: Layout) -> tuple:
    return (
        layout.tp,
        layout.pp,
        layout.cp,
        layout.ep,
        layout.zero_stage,
        layout.grad_reduce,
        layout.recompute,
        layout.layer_recompute,
    )


def schedule_against(est: Estimate, chosen: Estimate) -> str:
    """How the same layout under another pipeline schedule compares with the choice: step time, bubble and
    activation memory (the zero-bubble schedules trade a shorter bubble for the weight-gradient stash)."""
    bubble = est.pp_bubble - chosen.pp_bubble
    act = (est.memory["activations"] - chosen.memory["activations"]) / GIB
    verdict = (
        "does not fit" if not est.fits else ("slower" if est.step_time > chosen.step_time else "as fast")
    )
    return (
        f"{est.step_time - chosen.step_time:+.3f} s ({verdict}): bubble {bubble:+.3f} s, "
        f"activations {act:+.2f} GiB"
    )


def _schedule_alternatives(result: PlanResult, chosen: Estimate) -> list[tuple[Estimate, str]]:
    """The best estimate of the chosen layout under each other (schedule, virtual stages) evaluated."""
    lay = chosen.layout
    best: dict[tuple[str, int], Estimate] = {}
    for est in result.ranked:
        other = est.layout
        key = (other.schedule, other.virtual_stages)
        if key == (lay.schedule, lay.virtual_stages) or key in best:
            continue
        if replace(other, schedule=lay.schedule, virtual_stages=lay.virtual_stages) == lay:
            best[key] = est
    return [(e, schedule_against(e, chosen)) for e in best.values()]


def explain(result: PlanResult, view: ClusterView, runners_up: int = 5, misfits: int = 2) -> Explanation:
    """Explain `result.best`: its parts, and the best layout of up to `runners_up` other (tp, pp, cp, ep,
    zero, grad_reduce, recompute) families with what ruled each out; the first up to `misfits` of them are
    the fastest families that would beat the choice but do not fit."""
    chosen = result.best
    faster = sorted(
        (e for e in result.ranked if not e.fits and e.step_time < chosen.step_time), key=lambda e: e.step_time
    )
    seen = {_family(chosen.layout)}
    picked: list[Estimate] = []
    for pool, limit in ((faster, misfits), (result.ranked[1:], runners_up)):
        for est in pool:
            if len(picked) >= limit:
                break
            if _family(est.layout) not in seen:
                seen.add(_family(est.layout))
                picked.append(est)
    others = [(e, why_not(e, chosen, view)) for e in picked]
    schedules = _schedule_alternatives(result, chosen) if chosen.layout.pp > 1 else []
    return Explanation(
        chosen, time_parts(chosen), part_kinds(chosen.layout, view, chosen.float8_gather), others, schedules
    )


def format_explanation(expl: Explanation, precision: str, device: str) -> str:
    """The explanation as text: time split, memory split (report.tables.format_memory), runners-up."""
    c = expl.chosen
    lines = [f"why {c.layout.short()}:", f"  step time {c.step_time:.3f} s:"]
    for key, label in PART_LABELS.items():
        seconds = expl.parts[key]
        share = 100 * seconds / c.step_time if c.step_time else 0.0
        note = expl.kinds.get(key, "")
        lines.append(f"    {label:<22}{seconds:>9.3f} s {share:>5.1f}%   {note}".rstrip())
    lines.append(format_memory(c, precision, device))
    if expl.runners_up:
        lines.append(
            "runners-up (best of each other tp/pp/cp/ep/zero/grad-reduce/recompute family), "
            "and what ruled them out:"
        )
        lines += [f"  {e.layout.short()}: {why}" for e, why in expl.runners_up]
    if expl.schedules:
        sched = c.layout.schedule
        lines.append(
            f"{sched} wins over the other pipeline schedules of this layout (a zero-bubble schedule wins "
            "where its shorter bubble fits its weight-gradient stash):"
        )
        lines += [f"  {e.layout.schedule}(v={e.layout.virtual_stages}): {why}" for e, why in expl.schedules]
    return "\n".join(lines)
