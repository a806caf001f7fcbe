"""Why a plan splits the sequence (cp) or the experts (ep): its best layout against the best without.

The alternative is the best layout the search evaluated with that degree at 1 (every seed of the search is
screened, so one exists whenever the rules allow it). Each note says what the degree divides, then either
that no layout without it fits (and why, by the largest part of memory), or how much faster the choice is
and what its own communication costs per step.
"""

from __future__ import annotations

from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost.layout import GIB, Layout
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.search.uniform import PlanResult

STATE = ("params", "grads", "optimizer")


def _state_gib(e: Estimate) -> float:
    return sum(e.memory[k] for k in STATE) / GIB


def _versus(best: Estimate, alt: Estimate | None, degree: str) -> str:
    """How the best layout compares with `alt`, the best with `degree` at 1."""
    if alt is None:
        return f"no layout with {degree}=1 was possible"
    if not alt.fits:
        return f"no layout with {degree}=1 fits: the closest, {alt.layout.short()}, {alt.why}"
    ratio = alt.step_time / best.step_time
    return (
        f"{best.step_time:.3g} s per step against {alt.step_time:.3g} s ({ratio:.2f}x) "
        f"for the best layout with {degree}=1, {alt.layout.short()} ({alt.memory_gb:.1f} GiB)"
    )


def _inside_dp(layout: Layout) -> bool:
    return layout.dp % layout.ep == 0


def _placement(best: Estimate, result: PlanResult) -> str:
    """Where the best layout's EP group lies (C.ep_placement) and how it compares with the best evaluated
    layout of the same ep placed the other way: inside the DP ranks, or spanning CP or TP ranks."""
    lay = best.layout
    where = C.ep_placement(lay.tp, lay.cp, lay.dp, lay.ep)
    inside = _inside_dp(lay)
    alt = next((e for e in result.ranked if e.layout.ep == lay.ep and _inside_dp(e.layout) != inside), None)
    other = "inside dp" if not inside else "spanning CP or TP ranks"
    if alt is None:
        return f"placed {where}; no layout with ep={lay.ep} {other} was possible"
    if not alt.fits:
        return f"placed {where}; with ep={lay.ep} {other} the closest, {alt.layout.short()}, {alt.why}"
    return (
        f"placed {where}; with ep={lay.ep} {other} the best, {alt.layout.short()}, takes "
        f"{alt.step_time:.3g} s ({alt.step_time / best.step_time:.2f}x, EP all-to-alls {alt.ep_comm:.3g} s)"
    )


def parallelism_notes(result: PlanResult) -> list[str]:
    """A line per context- or expert-parallel degree above 1 of the best layout (none if it does not fit)."""
    best = result.best
    if not best.fits:
        return []
    lay, model = best.layout, result.workload.model
    notes = []
    if lay.cp > 1:
        alt = next((e for e in result.ranked if e.layout.cp == 1), None)
        tokens = result.workload.seq // lay.cp
        notes.append(
            f"cp={lay.cp} ({lay.cp_comm}): each rank holds {tokens} of the {result.workload.seq} tokens of a "
            f"sequence (activations / {lay.cp}), {best.cp_comm:.3g} s of context-parallel traffic per step "
            f"left exposed; {_versus(best, alt, 'cp')}"
        )
    if lay.ep > 1:
        alt = next((e for e in result.ranked if e.layout.ep == 1), None)
        state = f"{_state_gib(best):.1f} GiB of weights, gradients and optimizer state per rank"
        if alt is not None:
            state += f" (ep=1: {_state_gib(alt):.1f} GiB)"
        experts = f"{model.num_experts // lay.ep} of the {model.num_experts} experts"
        notes.append(
            f"ep={lay.ep}: each rank holds {experts} of a MoE layer, {state}; its dispatch and combine "
            f"all-to-alls take {best.ep_comm:.3g} s per step "
            f"(DP gradient reduction {best.dp_comm:.3g} s, {best.dp_exposed:.3g} s exposed); "
            f"{_versus(best, alt, 'ep')}; {_placement(best, result)}"
        )
    return notes
