"""How the kernels hand tensors to their autograd Functions (torch only: the PyTorch paths use it too, and
importing it must not import triton before TRITON_INTERPRET is read)."""

from __future__ import annotations

import torch


def apply_distinct(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)` with every repeat of a tensor among `args` (k is v, a residual that is the
    input) passed as a view of it, so each slot is a distinct input.

    torch.compile's autograd.Function support de-duplicates a tensor passed in two slots of `apply` and
    keeps only the last slot's gradient: with k is v the compiled backward returned dv alone for the shared
    tensor (pytorch#181146, silent in torch 2.11 on the H100: grad x off by 6.2 in fp32); torch 2.13 refuses
    the duplicate instead (graph break GB6297, pytorch#184281). A view is a separate input whose gradient
    autograd adds to its base's, compiled or not, and costs nothing eagerly."""
    distinct = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and any(arg is seen for seen in distinct):
            arg = arg.view_as(arg)
        distinct.append(arg)
    return function.apply(*distinct)
