"""Fused kernels with one dispatch point.

Each public function takes `impl`: "torch" runs the plain PyTorch path, "triton" the Triton kernel
(under TRITON_INTERPRET=1 on CPU tensors), "auto" Triton on CUDA and PyTorch elsewhere.
Model code calls these functions and never branches on the device itself.

TRITON_INTERPRET must be set before triton is first imported (this package imports it lazily, on the
first Triton call), e.g. `TRITON_INTERPRET=1 pytest tests/kernels` or os.environ in a conftest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import reference
from kernels.dispatch import resolve_impl

__all__ = [
    "apply_rotary",
    "cross_entropy",
    "flash_attention",
    "flash_attention_block",
    "flash_attention_block_grads",
    "fused_linear_cross_entropy",
    "geglu",
    "grouped_mm",
    "layer_norm",
    "moe_experts",
    "resolve_impl",
    "rms_norm",
    "swiglu",
]


def _add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    return x + residual


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    impl: str = "auto",
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual` returns (rms_norm(x + residual), x + residual)."""
    if resolve_impl(impl, x) == "triton":
        from kernels import norms

        return norms.rms_norm(x, weight, eps, residual)
    if residual is None:
        return reference.rms_norm(x, weight, eps)
    h = _add_residual(x, residual)
    return reference.rms_norm(h, weight, eps), h


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    impl: str = "auto",
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim; with `residual` returns (layer_norm(x + residual), x + residual)."""
    if resolve_impl(impl, x) == "triton":
        from kernels import norms

        return norms.layer_norm(x, weight, bias, eps, residual)
    if residual is None:
        return reference.layer_norm(x, weight, bias, eps)
    h = _add_residual(x, residual)
    return reference.layer_norm(h, weight, bias, eps), h


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    impl: str = "auto",
    *,
    position_offset: int = 0,
) -> torch.Tensor:
    """Rotary embedding of x (batch, seq, heads, head_dim); sequence position s uses row s + position_offset
    of cos/sin (positions, head_dim), which are applied element-wise as the PyTorch reference does."""
    from kernels.checks import check_rotary_args

    check_rotary_args(x, cos, sin, position_offset)
    if resolve_impl(impl, x) == "triton":
        from kernels import rotary

        return rotary.apply_rotary(x, cos, sin, interleaved, position_offset)
    seq = x.shape[1]
    rows = slice(position_offset, position_offset + seq)
    return reference.apply_rotary(x, cos[rows], sin[rows], interleaved)


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """silu(gate) * up."""
    if resolve_impl(impl, gate) == "triton":
        from kernels import glu

        return glu.swiglu(gate, up)
    return reference.swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """gelu_tanh(gate) * up."""
    if resolve_impl(impl, gate) == "triton":
        from kernels import glu

        return glu.geglu(gate, up)
    return reference.geglu(gate, up)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads (grouped-query).

    'auto' runs torch's scaled_dot_product_attention on CUDA too: its cuDNN/flash backends measured 2x our
    Triton kernel's forward+backward on an H100 (3.8 ms against 7.7 ms at LLaMA-3-8B shapes, seq 8192;
    benchmarks/results/20261125-164454-NVIDIA-H100-80GB-HBM3). impl='triton' still selects ours (the
    kernel tests, and where SDPA cannot serve).
    """
    if resolve_impl(impl, q, auto_on_cuda="torch") == "triton":
        from kernels import attention

        return attention.flash_attention(q, k, v, causal, softmax_scale)
    from kernels.checks import check_attention_args

    check_attention_args(q, k, v)
    return reference.flash_attention(q, k, v, causal, softmax_scale)


def _block_impl(impl: str, q: torch.Tensor, allowed: torch.Tensor | None) -> str:
    """The path of a block function: 'auto' keeps PyTorch on CUDA too until the Triton block kernels are
    measured there; the Triton kernels have no arbitrary (document) masks."""
    chosen = resolve_impl(impl, q, auto_on_cuda="torch")
    if chosen == "triton" and allowed is not None:
        raise ValueError(
            "the Triton attention kernels take no `allowed` mask (packed documents); use impl='torch'"
        )
    return chosen


def flash_attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    impl: str = "auto",
    *,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a longer attention, for ring attention: q (b, hq, n, d) at global positions q_offset..,
    k/v (b, hk, m, d) at k_offset.. -> (output (b, hq, n, d), log-sum-exp (b, hq, n)), both in at least
    fp32. Causal: key j is visible to query i when k_offset + j <= q_offset + i; a row that sees no key gets
    output 0 and log-sum-exp -inf. `allowed` (b, n, m) further restricts the pairs (PyTorch path only).
    The PyTorch path runs torch's fused CPU flash-attention kernel on CPU tensors (kernels/cpu_attention.py),
    the explicit one (kernels/reference.py) elsewhere."""
    if _block_impl(impl, q, allowed) == "triton":
        from kernels import attention

        return attention.attention_block(q, k, v, causal, softmax_scale, q_offset, k_offset)
    from kernels import cpu_attention
    from kernels.checks import check_attention_args

    check_attention_args(q, k, v)
    path = cpu_attention if cpu_attention.applies(q) else reference
    return path.attention_block(q, k, v, causal, softmax_scale, q_offset, k_offset, allowed)


def flash_attention_block_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    impl: str = "auto",
    *,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (at least fp32) of one flash_attention_block, given the rows' final log-sum-exp `lse`
    (b, hq, n) and final (merged) output `out` (b, hq, n, d), whose rowsum(dO * O) each path computes: the
    block's share of the gradient of the whole attention. Same masks, arguments and paths as
    flash_attention_block."""
    if _block_impl(impl, q, allowed) == "triton":
        from kernels import attention

        return attention.attention_block_grads(
            do, q, k, v, lse, out, causal, softmax_scale, q_offset, k_offset
        )
    from kernels import cpu_attention
    from kernels.checks import check_attention_args

    check_attention_args(q, k, v)
    path = cpu_attention if cpu_attention.applies(q) else reference
    return path.attention_block_grads(
        do, q, k, v, lse, out, causal, softmax_scale, q_offset, k_offset, allowed
    )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    tp_group: torch.distributed.ProcessGroup | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy over targets != ignore_index, in fp32.

    With `tp_group`, `logits` is this rank's vocab shard covering global ids [rank*V, (rank+1)*V) (rank in
    the group, V = logits.shape[-1]), `target` holds global ids, and every rank returns the full loss.
    """
    from kernels.checks import check_ce_args

    check_ce_args(logits, target)
    if resolve_impl(impl, logits) == "triton":
        from kernels import loss

        return loss.cross_entropy(logits, target, ignore_index, tp_group)
    if tp_group is not None:
        return reference.vocab_parallel_cross_entropy(logits, target, ignore_index, tp_group)
    return reference.cross_entropy(logits, target, ignore_index)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    impl: str = "auto",
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) computed chunk by chunk so the full logits never exist.

    Two passes (kernels/chunked_ce.py): over chunks of `chunk_tokens` tokens for the loss and
    grad_hidden, then over chunks of `chunk_vocab` weight rows for grad_weight, each of its rows written
    once. "triton" runs the per-chunk steps in Triton, "torch" in PyTorch ops. By default a chunk's
    logits are no larger than `hidden` (powers of two, at least 16).
    """
    if resolve_impl(impl, hidden) == "triton":
        from kernels import loss

        return loss.fused_linear_cross_entropy(
            hidden, weight, target, ignore_index, chunk_tokens, chunk_vocab
        )
    from kernels import chunked_ce

    return chunked_ce.fused_linear_cross_entropy(
        hidden, weight, target, ignore_index, chunk_tokens, chunk_vocab=chunk_vocab
    )


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Grouped GEMM: x (rows, K) split into groups of consecutive rows, group e ending at row
    offsets[e] (int32 (groups,), cumulative, offsets[-1] == rows: F.grouped_mm's offs), times weight[e]^T
    (weight (groups, N, K)) -> (rows, N). Groups may be empty."""
    from kernels.checks import check_grouped_mm_args

    check_grouped_mm_args(x, weight, offsets)
    if resolve_impl(impl, x) == "triton":
        from kernels import grouped_gemm

        return grouped_gemm.grouped_mm(x, weight, offsets)
    from kernels import grouped_torch

    return grouped_torch.grouped_mm(x, weight, offsets)


def moe_experts(
    rows: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert: expert e takes the next counts[e] rows and computes
    down[e] @ (silu(g) * u) with (g, u) = halves of gate_up[e] @ row (gate_up (E, 2F, H): rows [0:F] gate,
    [F:2F] up; down (E, H, F)). rows (sum(counts), H) -> (sum(counts), H). `counts` (E,): a tensor on rows'
    device, or ints (as expert parallelism has them on the host)."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, device=rows.device)
    offsets = counts.cumsum(0, dtype=torch.int32)
    from kernels.checks import check_grouped_mm_args

    # The down projection takes (rows, F) activations: a zero-row stand-in checks its shape the same way.
    check_grouped_mm_args(rows, gate_up, offsets)
    check_grouped_mm_args(rows.new_empty(0, gate_up.shape[1] // 2), down, offsets)
    if resolve_impl(impl, rows) == "triton":
        gu = grouped_mm(rows, gate_up, offsets, impl)
        h = swiglu(*gu.chunk(2, dim=-1), impl=impl)
        return grouped_mm(h, down, offsets, impl)
    from kernels import grouped_torch

    return grouped_torch.moe_experts(rows, offsets, gate_up, down)
