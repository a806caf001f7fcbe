"""Cluster description: devices, nodes and links; what a job sees of them; alpha-beta collective costs.

A cluster is a list of node groups (``count`` identical nodes, each with ``devices_per_node`` devices of one
kind and an intra-node link) plus one inter-node link. Node groups may differ (heterogeneous clusters); a job
on ``n`` devices uses the first nodes in file order, and because synchronous training runs at the pace of its
slowest member the cost model uses the slowest device, the smallest memory and the slowest links among them.

Links are described per device and direction: ``bandwidth_gbs`` is what one device can send at once (NVLink:
its NVLink bandwidth; InfiniBand: its NIC, e.g. 200 Gb/s = 25 GB/s) and ``latency_us`` the alpha of a message.
Collective costs follow the alpha-beta model with ring and tree algorithms (the cheaper one wins), as NCCL
picks; a group spanning nodes with ``k`` members per node drives ``k`` NICs in parallel (one ring per NIC).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from llmtrain.config.errors import ConfigError
from llmtrain.planner.cluster.interpolate import rate_at, time_at


@dataclass(frozen=True)
class Device:
    """One accelerator kind: peaks, memory and the achieved-efficiency curve's constants."""

    name: str
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s per precision (fp32, bf16, fp16, ...), not the 2:4-sparse figures."""
    memory_gb: float
    memory_bandwidth_gbs: float
    gemm_efficiency: float = 0.8
    """Fraction of peak that large, compute-bound matmuls reach (the top of the efficiency curve)."""
    memory_efficiency: float = 0.8
    """Fraction of the memory bandwidth that element-wise kernels reach."""
    attention_efficiency: float = 0.55
    """Fraction of peak a fused (flash) attention kernel reaches."""
    kernel_overhead_us: float = 4.0
    """Fixed cost per kernel (launch and tail); makes small operations inefficient."""
    reserved_gb: float = 2.0
    """Memory not available to tensors: runtime context, library workspaces, fragmentation."""
    host_bandwidth_gbs: float = 25.0
    """Device-host copy bandwidth per device, each way (PCIe Gen4/5 x16 achieves about 25-50 GB/s)."""
    host_adam_gparams: float = 0.4
    """Billions of parameters per second one device's share of the host CPU updates with a vectorised Adam
    (DeepSpeed's CPU Adam: a few per node, shared by its devices); used for CPU offload."""
    gemm_table: dict[str, list[list[float]]] = field(default_factory=dict)
    """Measured matmuls per precision, [FLOPs of one matmul, achieved TFLOP/s] each (tools/calibrate.py):
    where given, a matmul's time is its FLOPs over the rate interpolated at its FLOPs, replacing the peak x
    gemm_efficiency roofline; empty: the roofline."""
    host_op_us: float = 0.0
    """Host time per framework operator the trainer dispatches (Python, dispatcher, autograd recording and
    the backward node's own dispatch), measured by tools/calibrate.py on a tiny op chain; 0: not modelled."""
    fsdp_call_us: float = 0.0
    """Host time FSDP2 adds to each collective it issues (hooks, copy-in/out, DTensor bookkeeping), measured
    by tools/calibrate.py as a sharded unit's step minus its bare collectives; 0: not modelled."""
    host_is_device: bool = False
    """The device is the host CPU: operator overhead runs on the same cores as the compute and adds to it,
    rather than overlapping an accelerator's queue of kernels (read only with host_op_us)."""
    fresh_page_gbs: float = 0.0
    """GB/s at which the host maps and first touches fresh pages: what a CPU tensor of FRESH_PAGE_BYTES or
    more costs besides its kernel's work, since the allocator returns such buffers to the system when
    freed and gets new zeroed pages for the next one (tools/calibrate.py); 0: not modelled (a GPU's caching
    allocator reuses its blocks)."""
    memory_table: dict[str, list[list[float]]] = field(default_factory=dict)
    """Measured memory-bound operators per kind (MEMORY_KINDS), [bytes of one operator's tensor, achieved
    GB/s of the bytes the operators read and write] each (tools/calibrate.py): where given, memory-bound
    kernels whose tensor size the cost model knows run at the rate interpolated at that size (caches, fresh
    pages), replacing memory_bandwidth_gbs x memory_efficiency and the kernel overhead; empty: the
    bandwidth."""

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for a training precision (fp16 falls back to bf16 and vice versa)."""
        for key in (precision, {"fp16": "bf16", "bf16": "fp16"}.get(precision, precision)):
            if key in self.peak_tflops:
                return self.peak_tflops[key] * 1e12
        raise ConfigError(
            f"device {self.name} has no peak_tflops for precision {precision}; add it to the cluster file"
        )

    def _table(self, precision: str) -> list[list[float]]:
        for key in (precision, {"fp16": "bf16", "bf16": "fp16"}.get(precision, precision)):
            if key in self.gemm_table:
                return self.gemm_table[key]
        return []

    def gemm_time(self, m: float, n: float, k: float, precision: str, batch: float = 1.0) -> float:
        """Seconds for `batch` matmuls (m x k) @ (k x n) (one batched kernel): the measured rate at its FLOPs
        where gemm_table has the precision, else a soft roofline (compute plus operand traffic) plus the
        kernel overhead, so efficiency grows with size and arithmetic intensity."""
        flops = 2.0 * m * n * k * batch
        table = self._table(precision)
        if table:
            # The measured times include the call and kernel overheads: nothing is added to them.
            return flops / (rate_at(table, flops) * 1e12)
        nbytes = _bytes(precision) * (m * k + k * n + m * n) * batch
        compute = flops / (self.peak_flops(precision) * self.gemm_efficiency)
        return (
            compute
            + nbytes / (self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency)
            + self.kernel_overhead_us * 1e-6
        )

    def gemm_efficiency_at(self, m: float, n: float, k: float, precision: str = "bf16") -> float:
        """Achieved fraction of peak for one (m x k) @ (k x n) matmul: the efficiency curve."""
        return 2.0 * m * n * k / self.gemm_time(m, n, k, precision) / self.peak_flops(precision)

    def memory_time(
        self, nbytes: float, kernels: int = 1, tensor_bytes: float = 0.0, kind: str = "elementwise"
    ) -> float:
        """Seconds for memory-bound kernels of `kind` (MEMORY_KINDS) moving `nbytes` in total, each on
        tensors of `tensor_bytes` (0: not known): the measured rate at that size where memory_table has the
        kind, else the bandwidth plus the kernel overhead."""
        table = self.memory_table.get(kind)
        if table and tensor_bytes > 0:
            # The measured rates include the kernels' own per-call time (not the dispatch: host_op_us).
            return nbytes / (rate_at(table, tensor_bytes) * 1e9)
        return (
            nbytes / (self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency)
            + kernels * self.kernel_overhead_us * 1e-6
        )

    def fresh_time(self, nbytes: float) -> float:
        """Seconds a newly allocated tensor of `nbytes` adds when its pages are fresh (fresh_page_gbs, for
        tensors of at least FRESH_PAGE_BYTES)."""
        if not self.fresh_page_gbs or nbytes < FRESH_PAGE_BYTES:
            return 0.0
        return nbytes / (self.fresh_page_gbs * 1e9)

    def attention_time(self, flops: float, precision: str) -> float:
        """Seconds for a fused attention kernel of `flops`."""
        return (
            flops / (self.peak_flops(precision) * self.attention_efficiency) + self.kernel_overhead_us * 1e-6
        )


FRESH_PAGE_BYTES = 32 * 2**20
"""Allocations from this size on are mapped fresh from the system every time on Linux (glibc's mmap
threshold rises with freed blocks up to DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1024 * 1024 * sizeof(long) bytes on
64-bit: mallopt(3)), so their pages fault and are zeroed on first touch."""
MEMORY_KINDS = ("elementwise", "softmax")
"""Kinds of memory-bound operators Device.memory_table times: element-wise ones (norms, activation
functions, rotary embeddings, residual adds) and row-wise softmaxes (the cross-entropy's)."""


def _bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class Link:
    """A link class: per-device unidirectional bandwidth (GB/s), message latency (us), achieved fraction."""

    bandwidth_gbs: float
    latency_us: float
    efficiency: float = 0.85
    after_compute_us: float = 0.0
    """What a measured collective costs more when the ranks issue it after compute, as training does, than
    back to back as `measured` times it (their skew, the waiting thread's wake-up); tools/calibrate.py."""
    measured: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict)
    """Measured collectives inside one node of this link (tools/calibrate.py): operation (all_reduce,
    all_gather, reduce_scatter, send) -> group size -> [full-buffer bytes, seconds] each; where a group's
    operation is here its time is interpolated from them instead of the alpha-beta formula."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.efficiency

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6


MEASURED_ONLY = {
    "gemm_table",
    "memory_table",
    "fresh_page_gbs",
    "host_op_us",
    "fsdp_call_us",
    "measured",
    "after_compute_us",
}
"""Device and link fields that only calibration sets: unset (empty, 0), the cost model does not read them."""


def _read(obj: Device | Link, name: str) -> bool:
    """Whether the cost model reads field `name` of a device or link (host_is_device only with host_op_us)."""
    if name == "host_is_device":
        return bool(getattr(obj, "host_op_us", 0.0))
    return name not in MEASURED_ONLY or bool(getattr(obj, name))


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical nodes of `devices_per_node` devices joined by an intra-node link."""

    count: int
    devices_per_node: int
    device: Device
    intra: Link


@dataclass(frozen=True)
class Cluster:
    """Node groups plus the inter-node network."""

    name: str
    nodes: tuple[NodeGroup, ...]
    inter: Link
    cross_node_tp: bool = False
    """Whether tensor-parallel groups may span nodes (normally they stay on NVLink)."""
    source: str = field(default="", compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where each number comes from: "devices.NAME.FIELD" or "links.NAME.FIELD" -> citation text (vendor
    specification, published micro-benchmark, calibration run, or an assumption saying so)."""
    intra_names: tuple[str, ...] = field(default=(), compare=False)
    """The YAML names of the node groups' intra-node links (default intra_node, intra_node_1, ...)."""

    def constants(self) -> list[str]:
        """Dotted names of every number the cost model reads from this cluster (device and link fields; the
        measured-only ones where set)."""
        names = []
        for g in self.nodes:
            names += [
                f"devices.{g.device.name}.{f.name}"
                for f in fields(Device)
                if f.name != "name" and _read(g.device, f.name)
            ]
        links = dict(zip(link_names(self), [*(g.intra for g in self.nodes), self.inter], strict=False))
        for link_name, link in links.items():
            names += [f"links.{link_name}.{f.name}" for f in fields(Link) if _read(link, f.name)]
        return list(dict.fromkeys(names))

    def unsourced(self) -> list[str]:
        """The constants without an entry in `sources`."""
        return [name for name in self.constants() if name not in self.sources]

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.devices_per_node for g in self.nodes)

    def view(self, gpus: int) -> ClusterView:
        """The part of the cluster a job on `gpus` devices uses: first nodes in order, slowest members. A
        cluster of one node type is that type times any count: ceil(gpus / devices_per_node) nodes,
        whatever its file's count."""
        if gpus < 1:
            raise ConfigError(f"the number of GPUs must be at least 1; got {gpus}")
        if gpus > self.num_devices and len(self.nodes) > 1:
            raise ConfigError(
                f"{gpus} GPUs requested but cluster {self.name} has {self.num_devices} in node groups of "
                "different kinds (which kind to add is not given); pass a smaller --gpus or raise a node "
                "group's count in the cluster file"
            )
        used, left = [], gpus
        for group in self.nodes:
            if left <= 0:
                break
            used.append(group)
            left -= group.count * group.devices_per_node
        device = min((g.device for g in used), key=lambda d: (d.peak_tflops.get("bf16", 0), d.memory_gb))
        return ClusterView(
            devices=gpus,
            devices_per_node=min(min(g.devices_per_node for g in used), gpus),
            device=replace(
                device,
                memory_gb=min(g.device.memory_gb for g in used),
                memory_bandwidth_gbs=min(g.device.memory_bandwidth_gbs for g in used),
                reserved_gb=max(g.device.reserved_gb for g in used),
                host_bandwidth_gbs=min(g.device.host_bandwidth_gbs for g in used),
                host_adam_gparams=min(g.device.host_adam_gparams for g in used),
            ),
            intra=min((g.intra for g in used), key=lambda link: link.bytes_per_s),
            inter=self.inter,
            cross_node_tp=self.cross_node_tp,
        )


@dataclass(frozen=True)
class ClusterView:
    """What the cost model sees of a cluster for one job: uniform devices, two link classes."""

    devices: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    cross_node_tp: bool = False

    def members_per_node(self, size: int, stride: int) -> int:
        """How many members of a process group (`size` ranks, `stride` apart) share one node."""
        gpn = self.devices_per_node
        if size * stride <= gpn:
            return size
        return max(1, min(size, gpn // stride))

    def _path(self, size: int, stride: int) -> tuple[float, float, bool]:
        """(bytes/s per member, alpha, spans nodes) of the bottleneck link of a group."""
        k = self.members_per_node(size, stride)
        if k >= size:
            return self.intra.bytes_per_s, self.intra.alpha, False
        # k members per node send over k NICs at once; NVLink caps it when k NICs outrun it.
        return min(k * self.inter.bytes_per_s, self.intra.bytes_per_s), self.inter.alpha, True

    def _measured(self, op: str, nbytes: float, size: int, stride: int) -> float | None:
        """Seconds of a collective interpolated from the intra-node link's measurements, when the group stays
        in one node and its operation and size were measured; None otherwise."""
        points = self.intra.measured.get(op, {}).get(size)
        if not points or self.members_per_node(size, stride) < size:
            return None
        return time_at(points, nbytes) + self.intra.after_compute_us * 1e-6

    def spans_nodes(self, size: int, stride: int = 1) -> bool:
        """True when the group's ranks are on more than one node."""
        return size > 1 and self._path(size, stride)[2]

    def all_reduce(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for an all-reduce of `nbytes` per rank: min(ring, tree)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured("all_reduce", nbytes, size, stride)
        if measured is not None:
            return measured
        bw, alpha, _ = self._path(size, stride)
        ring = 2 * (size - 1) / size * nbytes / bw + 2 * (size - 1) * alpha
        tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(size)) * alpha
        return min(ring, tree)

    def all_gather(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for a ring all-gather with `nbytes` of result per rank."""
        return self._ring("all_gather", nbytes, size, stride)

    def reduce_scatter(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for a ring reduce-scatter of `nbytes` of input per rank (the all-gather's formula)."""
        return self._ring("reduce_scatter", nbytes, size, stride)

    def _ring(self, op: str, nbytes: float, size: int, stride: int) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured(op, nbytes, size, stride)
        if measured is not None:
            return measured
        bw, alpha, _ = self._path(size, stride)
        return (size - 1) / size * nbytes / bw + (size - 1) * alpha

    def all_to_all(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for an all-to-all of `nbytes` per rank in equal pieces: each rank sends (size-1)/size of
        its buffer, one piece per peer, and receives as much."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bw, alpha, _ = self._path(size, stride)
        return (size - 1) / size * nbytes / bw + (size - 1) * alpha

    def p2p(self, nbytes: float, cross_node: bool, parallel: int = 1) -> float:
        """Seconds for a point-to-point send of `nbytes`, `parallel` senders of one node sharing the work."""
        sends = self.intra.measured.get("send", {}).get(2)
        if sends and not cross_node and parallel == 1:
            return time_at(sends, nbytes) + self.intra.after_compute_us * 1e-6
        link = self.inter if cross_node else self.intra
        return nbytes / (parallel * link.bytes_per_s) + link.alpha


def link_names(cluster: Cluster) -> list[str]:
    """The YAML names of the node groups' intra-node links, then inter_node."""
    names = cluster.intra_names or tuple(
        "intra_node" if i == 0 else f"intra_node_{i}" for i in range(len(cluster.nodes))
    )
    return [*names, "inter_node"]
