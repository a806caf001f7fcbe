"""Fixtures of the parallel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def deepspeed_extensions() -> None:
    """DeepSpeed's CPU Adam, built before any worker process starts. Its C++ op compiles on first use
    (minutes on 2 cores) into TORCH_EXTENSIONS_DIR, torch's per-user cache unless set, which every test,
    worker and later session (and tools/pretrain.py) then loads from in about a second."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
