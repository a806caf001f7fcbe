"""Each rank's measured peak memory: at startup (building and sharding the model) and during training steps.

- CUDA: the caching allocator's peak of allocated bytes (torch.cuda.max_memory_allocated), always on; the
  peak is reset when startup ends, so the step figure is the training steps' own.
- CPU with `logging.memory`: the bytes of live tensors, tracked by PyTorch's own
  torch.distributed._tools.mem_tracker.MemTracker (a TorchDispatchMode that sees every tensor created inside
  it and frees it through a weak reference to its storage). It runs Python on every operator, which slows
  small operators noticeably, hence the switch.
- CPU without it: the process's peak resident set size, which also counts the interpreter, libraries and
  allocator caches (no separate startup figure).
These are what the planner's memory model (llmtrain.planner.cost.memory) predicts; benchmarks/bench_memory.py
compares the two.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

import torch
from torch.distributed._tools.mem_tracker import MemTracker

SOURCES = ("cuda allocator", "live tensors", "max rss")


class _ResettableMemTracker(MemTracker):
    """MemTracker counting totals only, whose overall peak can restart from the current bytes.

    Its per-module statistics are switched off: they refuse a module called twice in one iteration (every
    micro-batch of gradient accumulation and pipelining calls each layer again) and cost a loop over the
    modules per operator. The totals come from the storage tracking alone, which they do not affect.
    """

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: object) -> None:
        pass

    def _post_fw_hook(self, module: torch.nn.Module, inputs: object, outputs: object) -> None:
        pass

    def _pre_bw_hook(self, module: torch.nn.Module, args: object) -> None:
        pass

    def _post_bw_hook(self, module: torch.nn.Module, args: object) -> None:
        pass

    def reset_peak(self) -> None:
        # The same two fields MemTracker.__enter__ sets up from the current snapshot.
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

    def peak_bytes(self, device: torch.device) -> int:
        return int(self._peak_mem.get(device, 0))


class PeakMemory:
    """This rank's startup and training-step peaks in bytes (see the module docstring for the sources)."""

    def __init__(self, device: torch.device | str, track_cpu_tensors: bool) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.source = "cuda allocator"
        else:
            self.source = "live tensors" if track_cpu_tensors else "max rss"
        self._tracker = _ResettableMemTracker() if self.source == "live tensors" else None
        self.startup_bytes: int | None = None
        """The peak up to end_startup (None before it, and with the max rss source)."""

    @contextlib.contextmanager
    def tracking(self) -> Iterator[PeakMemory]:
        """Measure what runs inside (the tensor tracker is active only in this block, on this thread)."""
        if self._tracker is None:
            yield self
            return
        with self._tracker:
            yield self

    def end_startup(self) -> None:
        """Record the startup peak and restart the peak for the training steps."""
        if self.source == "cuda allocator":
            self.startup_bytes = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._tracker is not None:
            self.startup_bytes = self._tracker.peak_bytes(self.device)
            self._tracker.reset_peak()

    def peak_bytes(self) -> int:
        """The peak since end_startup (since the process started for the max rss source)."""
        if self.source == "cuda allocator":
            return torch.cuda.max_memory_allocated(self.device)
        if self._tracker is not None:
            return self._tracker.peak_bytes(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
