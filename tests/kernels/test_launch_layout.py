"""kernels._utils.launch_layout: what layout the Triton launches hand their kernels, eager and compiled."""

from __future__ import annotations

import torch

from kernels._utils import launch_layout


def test_eager_keeps_views_with_a_unit_last_stride():
    """Eager launches read the strides at run time: a view with a unit last stride is passed as it is."""
    base = torch.randn(4, 6, 8)
    view = base.transpose(0, 1)  # strides (8, 48, 1)
    assert launch_layout(view).data_ptr() == view.data_ptr()
    assert launch_layout(base.transpose(1, 2)).is_contiguous()  # last stride 6: copied


def test_compiling_makes_every_argument_contiguous(monkeypatch):
    """While torch.compile traces, the strides passed to a kernel are fixed then, and Inductor may lay a view
    argument out afresh (or a backward's gradient may arrive with other strides than traced): wholly
    contiguous tensors have the same strides in both, so the kernel indexes the memory it gets."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    view = torch.randn(4, 6, 8).transpose(0, 1)
    out = launch_layout(view)
    assert out.is_contiguous() and torch.equal(out, view)
    contiguous = torch.randn(3, 5)
    assert launch_layout(contiguous) is contiguous
