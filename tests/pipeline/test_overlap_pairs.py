"""DualPipeV's overlapped pairs stay deadlock-free: the executor runs a forward and the full backward after
it as one pair (llmtrain.parallel.turns), waiting for both computes' receives before it starts and posting
the sends between them after both. The simulator replays every dualpipe_v action list with each F-then-B
pair's transfers moved that way (every such pair, a superset of the MoE pairs the executor overlaps)."""

from __future__ import annotations

import pytest

from llmtrain.pipeline.schedules import RECV_B, RECV_F, Action, B, F, Schedule, build_schedule
from llmtrain.pipeline.simulator import simulate


def _paired(actions: list[Action]) -> list[Action]:
    """``actions`` with each F-then-B pair's receives before the F and its sends after the B."""
    computes = [i for i, a in enumerate(actions) if a.is_compute]
    order: list[Action] = []
    previous, k = -1, 0
    while k < len(computes):
        i = computes[k]
        order += actions[previous + 1 : i]
        if k + 1 < len(computes) and actions[i].kind == F and actions[computes[k + 1]].kind == B:
            j = computes[k + 1]
            between = actions[i + 1 : j]
            order += [a for a in between if a.kind in (RECV_F, RECV_B)] + [actions[i], actions[j]]
            order += [a for a in between if a.kind not in (RECV_F, RECV_B)]
            previous, k = j, k + 2
        else:
            order.append(actions[i])
            previous, k = i, k + 1
    return order + actions[previous + 1 :]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dualpipe_v_paired_is_deadlock_free(pp):
    for m in range(2 * pp, 3 * pp + 2):
        s = build_schedule("dualpipe_v", pp, m, 2)
        paired = [_paired(actions) for actions in s.actions]
        for moved, actions in zip(paired, s.actions, strict=True):
            assert sorted(map(str, moved)) == sorted(map(str, actions))
        # Raises ScheduleError on a deadlock or a dependency violation.
        simulate(Schedule(s.name, pp, m, 2, paired, s.v_shape), 1.0, 2.0, 1.0)
