"""kernels._utils: the layout a launch hands its kernel, and the custom ops the launches become under
torch.compile (their fake implementations against the real launches, by torch.library.opcheck)."""

from __future__ import annotations

import pytest
import torch

# Importing a kernel module registers its launches' ops.
from kernels import attention, glu, grouped_gemm, loss, norms, rotary  # noqa: F401
from kernels._utils import launch_layout
from tests.kernels.conftest import DEVICE, randn


def test_launch_layout_keeps_views_with_a_unit_last_stride():
    """Launches read the strides at run time: a view with a unit last stride is passed as it is."""
    base = torch.randn(4, 6, 8)
    view = base.transpose(0, 1)  # strides (8, 48, 1)
    assert launch_layout(view).data_ptr() == view.data_ptr()
    assert launch_layout(base.transpose(1, 2)).is_contiguous()  # last stride 6: copied
    assert launch_layout(torch.ones(()).expand(3, 5)).stride() == (5, 1)  # a broadcast gradient: copied


def test_launches_run_themselves_eagerly_and_as_ops_when_compiling(monkeypatch):
    """Eagerly the launch function itself runs (no dispatcher round trip); while compiling, its op."""
    x = torch.randn(8, 16, device=DEVICE)
    calls = []
    op = torch.ops.llmtrain_kernels.glu_forward.default
    real_op_call = type(op).__call__

    def spy(self, *args, **kwargs):
        calls.append(self)
        return real_op_call(self, *args, **kwargs)

    monkeypatch.setattr(type(op), "__call__", spy)
    glu._forward(x, x, False)
    assert calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    glu._forward(x, x, False)
    assert calls, "under compile the launch must go through llmtrain_kernels::glu_forward"


def _r(*shape, dtype=torch.float32):
    return randn(*shape, dtype=dtype, grad=False)


def _op_samples() -> dict[str, tuple]:
    """One call of each op, some tensors non-contiguous views, one tensor in two places."""
    kv, h, ends = _r(1, 2, 16, 32), _r(24, 64), torch.tensor([0, 8, 8, 24], dtype=torch.int32, device=DEVICE)
    return {
        "attention_forward": (_r(1, 4, 16, 32), kv, kv, True, 0.2, 0, torch.float32),
        "attention_delta": (_r(1, 4, 16, 32), _r(1, 16, 4, 32).transpose(1, 2)),
        "attention_backward": (
            _r(1, 4, 16, 32), _r(1, 4, 16, 32), kv, kv, _r(1, 4, 16), _r(1, 4, 16), True, 0.2, 0, None,
        ),
        "norm_forward": (h, h, _r(64), None, 1e-5, True),
        "norm_backward": (h, _r(64), _r(64), _r(24, 64), None, _r(24), _r(24), False),
        "rotary": (_r(1, 16, 8, 4, 32)[:, :, :, 0], _r(16, 32), _r(16, 32), False, 0, False),
        "glu_forward": (h, h, False),
        "glu_backward": (h, _r(24, 128)[:, :64], h, True),
        "grouped_mm": (h, _r(3, 16, 64), ends, False),
        "grouped_mm_weight_grad": (_r(24, 16), h, ends, 3),
        "cross_entropy_row_stats": (_r(24, 96), torch.arange(24, device=DEVICE) * 3, 0),
        "cross_entropy_logit_grad": (_r(24, 96), torch.arange(24, device=DEVICE) * 3, _r(24), _r(24), 0),
    }  # fmt: skip


OP_NAMES = list(_op_samples())


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_fake_matches_the_launch(name):
    """opcheck: the schema, and the fake implementation's shapes, dtypes and strides against the real
    launch's (what Inductor plans the op's outputs with)."""
    op = getattr(torch.ops.llmtrain_kernels, name).default
    torch.library.opcheck(op, _op_samples()[name], test_utils=("test_schema", "test_faketensor"))


def test_every_registered_op_has_a_sample():
    """A new launch op needs a sample above."""
    registered = {
        name
        for name in dir(torch.ops.llmtrain_kernels)
        if isinstance(getattr(torch.ops.llmtrain_kernels, name), torch._ops.OpOverloadPacket)
    }
    assert registered == set(OP_NAMES)
