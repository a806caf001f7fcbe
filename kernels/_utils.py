"""Helpers shared by the Triton kernels: interpreter detection, launch configs, input checks."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
import triton


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1), where kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device, work_items: int) -> int:
    """Programs for a persistent (grid-stride) kernel: a few per SM on CUDA, few under the interpreter.

    The interpreter costs about a millisecond per program instance, so there we keep the grid tiny.
    """
    if device.type == "cuda":
        return max(1, min(work_items, 4 * _sm_count(device.index or 0)))
    return max(1, min(work_items, 4))


def launch_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along the last dim, as every kernel indexes it (copied only where it must be).
    Launches call it at run time, inside their `compiled_as_op` body, so the strides they hand a kernel are
    always the tensor's own."""
    return t if t.stride(-1) == 1 else t.contiguous()


def compiled_as_op(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator for a kernel launch (tensors in, freshly allocated tensors out, nothing mutated): eagerly
    the launch runs as itself; while torch.compile traces, as the custom op `llmtrain_kernels::<name>`,
    whose output shapes, dtypes and strides `fake` gives (same arguments, meta tensors out).

    Traced directly, a user-defined Triton launch is inlined into Inductor's graph as a kernel call whose
    stride arguments were read from fake tensors at trace time and whose pointer arguments are analysed and
    functionalised one by one; when one tensor feeds two of them (k is v, a gradient passed as two
    arguments) or Inductor lays a buffer out other than traced, the compiled graph hands the kernel memory
    that does not match the strides it was given. As a custom op the launch is one opaque call: Inductor
    passes it real tensors, and the launch reads their strides, aliasing included, when it runs."""

    def wrap(launch: Callable) -> Callable:
        op = torch.library.custom_op(f"llmtrain_kernels::{name}", launch, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(launch)
        def dispatch(*args, **kwargs):
            return (op if torch.compiler.is_compiling() else launch)(*args, **kwargs)

        return dispatch

    return wrap


def autotuning() -> bool:
    """False when LLMTRAIN_AUTOTUNE=0: CUDA launches then use each kernel's first config, as the
    interpreter does. Correctness runs set it (the GPU kernel tests, loss curves) to skip compiling and
    timing every config for every new shape; tests/kernels/test_attention.py checks each config itself."""
    return os.environ.get("LLMTRAIN_AUTOTUNE", "1") != "0"


def tuned(kernel: triton.JITFunction, configs: Sequence[triton.Config], key: list[str]) -> Callable:
    """The kernel autotuned over `configs` on CUDA; the interpreter gets the first config only.

    Autotuning with several configs calls the CUDA driver's benchmarker, which fails under the
    interpreter, so the Autotuner is built lazily and only when a real GPU launches the kernel.
    """
    interp = triton.autotune(configs=list(configs[:1]), key=key)(kernel)
    cached: dict[str, Callable] = {}

    def pick(device: torch.device) -> Callable:
        if device.type != "cuda" or not autotuning():
            return interp
        if "cuda" not in cached:
            cached["cuda"] = triton.autotune(configs=list(configs), key=key)(kernel)
        return cached["cuda"]

    return pick


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the argument when tensors live on different devices."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; move them together"
            )
