"""Layouts place every local element at its full-tensor position (reference: slicing the full tensor)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtrain.parallel.param_layout import ParamLayout, tp_layout


def _check_pieces(full: torch.Tensor, pieces: list, expected_numel: int) -> None:
    assert sum(p.tensor.numel() for p in pieces) == expected_numel
    for p in pieces:
        region = full[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.tensor.shape, strict=True))]
        assert torch.equal(p.tensor, region)


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[torch.Tensor, ParamLayout, torch.Tensor]:
    """A full tensor with unique values, a TP-style layout of it, and the local tensor sliced from it."""
    tp = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["rows", "cols", "gate_up"]))
    rank = draw(st.integers(0, tp - 1))
    rows = draw(st.integers(1, 3)) * tp * 2
    trailing = [] if kind == "cols" else draw(st.lists(st.integers(1, 3), max_size=1))
    shape = (rows, draw(st.integers(1, 3)) * tp, *trailing)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    if kind == "rows":
        n = rows // tp
        local = full[rank * n : (rank + 1) * n]
    elif kind == "cols":
        n = shape[1] // tp
        local = full[:, rank * n : (rank + 1) * n]
    else:
        f = rows // 2 // tp
        local = torch.cat(
            [full[rank * f : (rank + 1) * f], full[rows // 2 + rank * f : rows // 2 + (rank + 1) * f]]
        )
    tensor = local.clone()
    tensor.tp_layout = kind
    layout = tp_layout("w", tensor, tp, rank)
    layout.check("w")
    assert layout.global_shape == shape
    return full, layout, local.contiguous()


@settings(max_examples=60, deadline=None)
@given(_layouts(), st.data())
def test_flat_ranges_land_where_they_belong(case: tuple, data: st.DataObject) -> None:
    full, layout, local = case
    flat = local.reshape(-1)
    start = data.draw(st.integers(0, flat.numel() - 1))
    end = data.draw(st.integers(start + 1, flat.numel()))
    pieces = layout.flat_pieces(flat[start:end], start)
    _check_pieces(full, pieces, end - start)
    assert len(pieces) <= (2 * full.dim() - 1) * len(layout.blocks)


@settings(max_examples=30, deadline=None)
@given(_layouts())
def test_whole_local_tensor(case: tuple) -> None:
    full, layout, local = case
    _check_pieces(full, layout.pieces(local), local.numel())


def test_replicated_kv_heads_have_one_writer() -> None:
    # tp=4 over 2 kv heads of width 3: ranks 0,1 hold head 0, ranks 2,3 head 1; ranks 0 and 2 write.
    full = torch.arange(6 * 5).reshape(6, 5)
    for rank in range(4):
        local = full[(rank // 2) * 3 : (rank // 2 + 1) * 3].clone()
        local.tp_layout = ("kv", 2)
        local.duplicate = rank % 2 == 1
        layout = tp_layout("k", local, 4, rank)
        assert layout.global_shape == (6, 5) and layout.writer == (rank % 2 == 0)
        _check_pieces(full, layout.pieces(local), local.numel())
