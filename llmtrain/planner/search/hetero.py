"""Heterogeneous clusters planned as a whole: uneven layers per pipeline stage, or uneven micro-batches per
data-parallel replica, in proportion to each device's speed.

The search ranks layouts on the cluster's slowest view (Cluster.view); this module places a layout on the
node groups. Ranks fill the groups in file order under the trainer's default rank order (tp innermost, then
cp, dp, pp), so pipeline stage s holds ranks [s n, (s + 1) n), n = tp cp dp, and with pp = 1 replica r holds
ranks [r tp cp, (r + 1) tp cp). A stage or replica runs at the pace of its slowest device, whose costs are the
cost model's on a cluster of that device only. Then, with the simplest honest model:

* pp > 1 (one chunk per rank): layers go one at a time to the stage whose forward + backward grows least.
  Per-stage time rises with its layers, so this greedy min-max is optimal (tests check it by brute force).
* pp = 1, dp > 1: micro-batches likewise go to the replica that would finish first; the step's compute is
  the slowest replica's, as the gradient reduction waits for it.

The plan's pipeline time is replayed by the pipeline simulator with the per-stage costs, and the gain is
against the same layout with the trainer's even split on the same devices. The data-parallel reduction and
the optimizer are taken from the slowest view on both sides. Memory is checked conservatively: the layout's
largest stage against the smallest device (the memory model does not place stages on devices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from llmtrain.config import JobConfig
from llmtrain.config.validate import rank_order, uneven_batch_problem
from llmtrain.planner.cluster.hardware import Cluster, Device
from llmtrain.planner.cost.layout import Layout, Software, Workload, with_layout
from llmtrain.planner.cost.model import CostModel, Estimate
from llmtrain.planner.cost.pipeline_time import pipeline_time


@dataclass(frozen=True)
class HeteroPlan:
    """One layout placed on a heterogeneous cluster, with its uneven split and the even split's time."""

    estimate: Estimate
    """The layout (with its stage_layers) as the slowest view estimates it: memory, collectives, optimizer."""
    devices: tuple[str, ...]
    """The device setting the pace of each pipeline stage (pp > 1) or data-parallel replica (pp = 1)."""
    dp_micro_batches: tuple[int, ...]
    """Micro-batches per replica (train.dp_micro_batches); empty for a pipeline plan."""
    step_time: float
    """Predicted step: the uneven split's pipeline (simulated) or slowest replica, plus DP and optimizer."""
    even_step_time: float
    """The same layout with the trainer's even split (layers and micro-batches) on the same devices."""
    closed_form_step_time: float
    """step_time with the pipeline's closed form instead of the simulator's replay."""

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def gain(self) -> float:
        """How many times faster than the best even split of this layout."""
        return self.even_step_time / self.step_time

    def overrides(self) -> dict[str, object]:
        """The config settings the trainer reads: parallel.stage_layers and train.dp_micro_batches."""
        return {
            "parallel.stage_layers": list(self.layout.stage_layers or ()),
            "train.dp_micro_batches": list(self.dp_micro_batches),
        }

    def format(self) -> str:
        """The report's lines: where each part runs, its share, and the gain."""
        if self.dp_micro_batches:
            parts, what = self.dp_micro_batches, "micro-batches per replica"
        else:
            parts, what = self.layout.stage_layers or (), "layers per stage"
        runs: list[list] = []  # [count of parts, share, device], consecutive equal parts merged
        for n, device in zip(parts, self.devices, strict=True):
            if runs and runs[-1][1:] == [n, device]:
                runs[-1][0] += 1
            else:
                runs.append([1, n, device])
        placed = ", ".join(f"{k} x {n} on {d}" if k > 1 else f"{n} on {d}" for k, n, d in runs)
        return (
            f"heterogeneous plan for {self.layout.short()}: {what} {placed}\n"
            f"step {self.step_time:.3f}s (closed form {self.closed_form_step_time:.3f}s) against "
            f"{self.even_step_time:.3f}s for the even split: {self.gain:.2f}x"
            + ("" if self.estimate.fits else f"; does not fit: {self.estimate.why}")
        )


def rank_devices(cluster: Cluster, gpus: int) -> list[Device]:
    """The device of each rank: the node groups' devices in file order."""
    devices = [g.device for g in cluster.nodes for _ in range(g.count * g.devices_per_node)]
    return devices[:gpus]


def _slowest(devices: list[Device], precision: str) -> Device:
    return min(devices, key=lambda d: (d.peak_flops(precision), d.memory_gb))


def _min_max(costs: Sequence[Callable[[int], float]], total: int) -> list[int]:
    """Counts (each at least 1, summing to `total`) minimising max_i costs[i](counts[i]), costs increasing:
    each unit goes to the part whose cost grows to the least."""
    counts = [1] * len(costs)
    for _ in range(total - len(costs)):
        best = min(range(len(costs)), key=lambda i: costs[i](counts[i] + 1))
        counts[best] += 1
    return counts


class HeteroPlanner:
    """Places layouts of one workload on a heterogeneous cluster (see the module docstring)."""

    def __init__(
        self, workload: Workload, cluster: Cluster, gpus: int, software: Software | None = None
    ) -> None:
        self.w, self.cluster, self.gpus = workload, cluster, gpus
        self.software = software or Software()
        self.slowest = CostModel(workload, cluster.view(gpus), self.software)
        self.devices = rank_devices(cluster, gpus)
        self._models: dict[str, CostModel] = {}

    def model_of(self, device: Device) -> CostModel:
        """The cost model of a cluster of `device` alone (its node group, any count)."""
        if device.name not in self._models:
            group = next(g for g in self.cluster.nodes if g.device.name == device.name)
            alone = Cluster(device.name, (group,), self.cluster.inter, self.cluster.cross_node_tp)
            self._models[device.name] = CostModel(self.w, alone.view(self.gpus), self.software)
        return self._models[device.name]

    def unsupported(self, layout: Layout, job: JobConfig) -> str:
        """Why this layout gets no uneven split ("" if it does)."""
        if len({d.name for d in self.devices}) < 2:
            return "the devices used are all of one kind"
        if rank_order(job.parallel) != ["tp", "cp", "dp", "pp"]:
            return f"parallel.order={job.parallel.order}: stages and replicas are placed for tp-dp-pp only"
        if layout.pp > 1:
            if layout.virtual_stages > 1 or layout.layer_recompute:
                return "uneven stages are planned for one chunk per rank and one recompute mode"
            return ""
        if layout.dp < 2:
            return "one data-parallel replica and no pipeline: nothing to split"
        total = self.w.global_batch // layout.micro_batch
        if total < layout.dp:
            return "fewer micro-batches than replicas"
        probe = with_layout(job, layout, self.w.global_batch)
        counts = [1] * (layout.dp - 1) + [total - layout.dp + 1]
        return uneven_batch_problem(
            replace(probe, train=replace(probe.train, dp_micro_batches=counts)), layout.dp
        )

    def _part_devices(self, layout: Layout) -> list[Device]:
        parts = layout.pp if layout.pp > 1 else layout.dp
        size = self.gpus // parts
        return [_slowest(self.devices[i * size : (i + 1) * size], self.w.precision) for i in range(parts)]

    def plan(self, layout: Layout, job: JobConfig) -> HeteroPlan | None:
        """The uneven split of `layout` and its gain; None when unsupported(layout, job) says why not."""
        if self.unsupported(layout, job):
            return None
        devices = self._part_devices(layout)
        if layout.pp > 1:
            return self._pipeline_plan(layout, devices)
        return self._replica_plan(layout, devices)

    def _stage_costs(self, layout: Layout, devices: list[Device]) -> tuple[list[float], ...]:
        """Per stage: forward, backward and weight-gradient seconds of one micro-batch on its device."""
        out: tuple[list[float], ...] = ([], [], [])
        for stage, device in enumerate(devices):
            costs = self.model_of(device).rank_costs(layout)
            for kept, column in zip(out, costs[:3], strict=True):
                kept.append(column[stage])
        return out

    def _rest(self, estimate: Estimate) -> float:
        """What follows the compute: the exposed data-parallel reduction and the optimizer step."""
        return estimate.dp_exposed + estimate.optimizer

    def _pipeline_plan(self, layout: Layout, devices: list[Device]) -> HeteroPlan:
        pp, m = layout.pp, self.w.global_batch // (layout.dp * layout.micro_batch)

        def cost(stage: int) -> Callable[[int], float]:
            """Seconds of the stage's forward + backward of one micro-batch holding n layers."""

            def of(n: int) -> float:
                layers = [1] * pp
                layers[stage] = n
                fwd, bwd, _ = self._stage_costs(replace(layout, stage_layers=tuple(layers)), devices)
                return fwd[stage] + bwd[stage]

            return of

        layers = tuple(_min_max([cost(s) for s in range(pp)], self.w.model.num_layers))
        planned = replace(layout, stage_layers=layers)
        even = replace(layout, stage_layers=self.slowest.chunk_layers(layout))
        p2p = self.slowest.p2p_time(layout)

        def pipe(lay: Layout, simulate: bool) -> float:
            fwd, bwd, wgt = self._stage_costs(lay, devices)
            return pipeline_time(lay.schedule, pp, m, 1, fwd, bwd, wgt, p2p, simulate).step_time

        estimate = self.slowest.evaluate(planned)
        rest = self._rest(estimate)
        return HeteroPlan(
            estimate=estimate,
            devices=tuple(d.name for d in devices),
            dp_micro_batches=(),
            step_time=pipe(planned, True) + rest,
            even_step_time=pipe(even, True) + rest,
            closed_form_step_time=pipe(planned, False) + rest,
        )

    def _replica_plan(self, layout: Layout, devices: list[Device]) -> HeteroPlan:
        micro = [sum(self.model_of(d).rank_costs(layout)[i][0] for i in (0, 1)) for d in devices]
        total = self.w.global_batch // layout.micro_batch
        counts = _min_max([lambda n, t=t: n * t for t in micro], total)
        estimate = self.slowest.evaluate(layout)
        rest = self._rest(estimate)
        step = max(n * t for n, t in zip(counts, micro, strict=True)) + rest
        return HeteroPlan(
            estimate=estimate,
            devices=tuple(d.name for d in devices),
            dp_micro_batches=tuple(counts),
            step_time=step,
            even_step_time=total // layout.dp * max(micro) + rest,
            closed_form_step_time=step,
        )

    def best(self, ranked: list[Estimate], job: JobConfig, top: int = 20) -> HeteroPlan | None:
        """The fastest uneven split among the `top` best fitting layouts of the search (None: none apply)."""
        plans = [self.plan(e.layout, job) for e in [e for e in ranked if e.fits][:top]]
        found = [p for p in plans if p is not None and p.estimate.fits]
        return min(found, key=lambda p: p.step_time, default=None)
