"""The PyTorch path of the MoE experts: grouped GEMM on torch._grouped_mm (F.grouped_mm), the library's
one-call kernel, where it takes the operands, else one matrix product per group; and SwiGLU on the packed
gate_up output.

torch 2.13 runs _grouped_mm on CPU for fp32, bf16 and fp16 with 16-byte aligned strides (on CUDA: bf16).
Its own backward rejects an incoming gradient with zero strides (what `.sum()` hands back), so this autograd
Function makes the gradient contiguous and calls _grouped_mm for dX and dW itself. It also cannot write an
output dtype other than its inputs' on CPU, so every product here stays in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.autograd_inputs import apply_distinct

_GMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def library_takes(*tensors: torch.Tensor) -> bool:
    """_grouped_mm supports these operands: its dtypes, strides and base pointers 16-byte aligned, no empty
    dimension (it rejects the strides of a 0-row tensor)."""
    for t in tensors:
        if t.numel() == 0:
            return False
        # On CUDA, torch documents bf16 on SM80+ only; the rest takes the per-group products.
        if t.is_cuda and (t.dtype != torch.bfloat16 or torch.cuda.get_device_capability(t.device) < (8, 0)):
            return False
        if t.dtype not in _GMM_DTYPES or t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    return True


def _counts(offsets: torch.Tensor) -> list[int]:
    return torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()


def _mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Group e of a's rows times b[e]: a (M, K) and b (E, K, N) -> (M, N)."""
    if library_takes(a, b):
        return F.grouped_mm(a, b, offs=offsets)
    return torch.cat([rows @ b[e] for e, rows in enumerate(a.split(_counts(offsets)))])


def _mm_dw(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(E, N, K) per-group dY_e^T @ X_e for dy (M, N) and x (M, K)."""
    if library_takes(dy, x):
        return F.grouped_mm(dy.t(), x, offs=offsets)
    counts = _counts(offsets)
    return torch.stack([a.t() @ b for a, b in zip(dy.split(counts), x.split(counts), strict=True)])


class _GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return _mm(x, weight.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dy = dy.contiguous()  # _grouped_mm rejects the zero-stride gradient of a sum
        dx = _mm(dy, weight, offsets) if ctx.needs_input_grad[0] else None
        dw = _mm_dw(dy, x, offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """PyTorch grouped x @ weight[e]^T (see kernels.grouped_mm)."""
    return apply_distinct(_GroupedMMFn, x, weight, offsets)


class _PackedSwiGLUFn(torch.autograd.Function):
    """silu(gate) * up for gu = [gate | up] (rows, 2F), whose backward writes d(gu) in one (rows, 2F) buffer.

    Through autograd, chunk + silu * up ends in a concatenation of the two gradient halves (a copy of the
    whole buffer); here each half is written in place."""

    @staticmethod
    def forward(ctx, gu):
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gu, act)
        return act * up

    @staticmethod
    def backward(ctx, dh):
        gu, act = ctx.saved_tensors
        gate, up = gu.chunk(2, dim=-1)
        if torch.is_grad_enabled():
            # A double backward (create_graph, as a Hessian-vector product needs): differentiable ops from
            # gu itself, since the saved activation carries no graph. silu'(g) = s (1 + g (1 - s)).
            s = torch.sigmoid(gate)
            return torch.cat((dh * up * s * (1 + gate * (1 - s)), dh * gate * s), dim=-1)
        dgu = torch.empty_like(gu)
        d_gate, d_up = dgu.chunk(2, dim=-1)
        torch.mul(dh, act, out=d_up)
        torch.ops.aten.silu_backward.grad_input(dh * up, gate, grad_input=d_gate)
        return dgu


def swiglu_packed(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] along the last dim, in PyTorch."""
    return _PackedSwiGLUFn.apply(gu)


def _experts_composed(rows, gate_up, down, offsets):
    """The experts from the differentiable pieces (what a double backward differentiates)."""
    h = swiglu_packed(grouped_mm(rows, gate_up, offsets))
    return grouped_mm(h, down, offsets)


class _ExpertsFn(torch.autograd.Function):
    """grouped_mm -> SwiGLU -> grouped_mm in one Function whose backward writes its large intermediates
    into the forward's own buffers: on CPU every fresh tensor of more than a few MB is a new mapping whose
    pages fault in on first touch (as costly as the elementwise pass that fills it), so reusing them
    removes most of the block's non-GEMM time. Saves the rows, gate_up's output and the activation, as
    the separate Functions did, less silu(gate)."""

    @staticmethod
    def forward(ctx, rows, gate_up, down, offsets):
        gu = _mm(rows, gate_up.transpose(-2, -1), offsets)
        gate, up = gu.chunk(2, dim=-1)
        h = F.silu(gate)
        h.mul_(up)
        ctx.save_for_backward(rows, gate_up, down, offsets, gu, h)
        ctx.consumed = False
        return _mm(h, down.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, dy):
        rows, gate_up, down, offsets, gu, h = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (a Hessian-vector product): differentiate the composed ops on the saved inputs.
            with torch.enable_grad():
                y = _experts_composed(rows, gate_up, down, offsets)
            inputs = zip((rows, gate_up, down), ctx.needs_input_grad[:3], strict=True)
            wanted = [t for t, need in inputs if need]
            got = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
            return *[next(got) if need else None for need in ctx.needs_input_grad[:3]], None
        if ctx.consumed:  # a repeated backward (retain_graph): the buffers were overwritten, recompute them
            gu = _mm(rows, gate_up.transpose(-2, -1), offsets)
            gate, up = gu.chunk(2, dim=-1)
            h = F.silu(gate).mul_(up)
        ctx.consumed = True
        # Overwritten through .data: they are this Function's own buffers (made in forward, never returned),
        # and the version counter would otherwise refuse the recomputing repeat above.
        gu, h = gu.data, h.data
        dy = dy.contiguous()  # _grouped_mm rejects the zero-stride gradient of a sum
        d_down = _mm_dw(dy, h, offsets) if ctx.needs_input_grad[2] else None
        dh = _mm(dy, down, offsets)
        gate, up = gu.chunk(2, dim=-1)
        act = torch.ops.aten.silu.out(gate, out=h)
        up.mul_(dh)
        torch.ops.aten.silu_backward.grad_input(up, gate, grad_input=gate)
        torch.mul(dh, act, out=up)
        d_gate_up = _mm_dw(gu, rows, offsets) if ctx.needs_input_grad[1] else None
        d_rows = _mm(gu, gate_up, offsets) if ctx.needs_input_grad[0] else None
        return d_rows, d_gate_up, d_down, None


def moe_experts(
    rows: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """PyTorch SwiGLU experts (see kernels.moe_experts)."""
    return apply_distinct(_ExpertsFn, rows, gate_up, down, offsets)
