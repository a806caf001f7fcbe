"""Fixtures of the parallel tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.parallel._reference import STORE


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


@pytest.fixture(scope="session", autouse=True)
def reference_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A folder for the session's float64 references (tests/parallel/_reference.py, stored_reference),
    named in the environment the spawned ranks inherit: each reference is computed once per session,
    however many world sizes, layouts and tests compare against it."""
    os.environ[STORE] = str(tmp_path_factory.mktemp("references"))
    yield
    del os.environ[STORE]
