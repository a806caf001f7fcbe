"""A second RNG stream for randomness that must differ between tensor-parallel ranks.

Dropout on replicated activations uses torch's default generator, identical on every TP rank because every
rank is seeded alike. Dropout on sharded activations (attention heads, sequence-parallel regions) must draw
different masks per rank: it runs inside `tracker.fork()`, which swaps in a per-rank generator state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class RNGTracker:
    """Holds a per-TP-rank generator state and swaps it in around sharded-activation randomness."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def get_states(self) -> torch.Tensor:
        """The tracker's current state (for rewinding around recomputation)."""
        return self.state.clone()

    def set_states(self, state: torch.Tensor) -> None:
        """Rewind the tracker to a state from get_states."""
        self.state = state.clone()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the tracker's stream; the default stream is left exactly as it was."""
        default = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(default)

    def wrap(self, module: torch.nn.Module) -> None:
        """Run `module`'s forward on the tracker's stream (via hooks, so names and type stay)."""
        stack: list[contextlib.AbstractContextManager] = []

        def pre(*_: object) -> None:
            ctx = self.fork()
            ctx.__enter__()
            stack.append(ctx)

        def post(*_: object) -> None:
            stack.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
