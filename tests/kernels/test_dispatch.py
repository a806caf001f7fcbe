"""kernels' dispatch: 'auto' picks PyTorch off CUDA, explicit choices are validated with actionable errors."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference


def test_auto_on_cpu_runs_the_torch_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("auto must not reach the Triton kernel on CPU")

    import kernels.norms

    monkeypatch.setattr(kernels.norms, "rms_norm", fail)
    x, w = torch.randn(3, 8), torch.randn(8)
    assert kernels.resolve_impl("auto", x) == "torch"
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6, "auto"), reference.rms_norm(x, w, 1e-6))


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="one of auto, triton, torch"):
        kernels.swiglu(torch.randn(2), torch.randn(2), impl="cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.swiglu(torch.randn(2), torch.randn(2), impl="triton")
