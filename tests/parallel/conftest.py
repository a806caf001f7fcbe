"""Fixtures of the parallel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def deepspeed_extensions() -> None:
    """DeepSpeed's CPU Adam, built before any worker process starts. Its C++ op compiles on first use
    (minutes on 2 cores) into TORCH_EXTENSIONS_DIR, torch's per-user cache unless set, which every test,
    worker and later session (and tools/pretrain.py) then loads from in about a second. That folder is
    named by the Python and CUDA versions only (py311_cpu) and ninja rebuilds the op whenever its compile
    command changes: a session in another virtual environment (other include paths) or a freshly installed
    one (newer headers) rebuilds it, once, and a session back in the first one rebuilds it again."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
