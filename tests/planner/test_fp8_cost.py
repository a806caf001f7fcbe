"""The cost model under train.precision=fp8 (llmtrain.parallel.float8): which matmuls it times at the float8
rate, and the cast passes it adds. Reference: a hand count of the layer's linear layers."""

from __future__ import annotations

from llmtrain.config import load
from llmtrain.planner import CostModel, Workload, load_cluster


def _cost(precision: str, config: str = "configs/llama-3b.yaml") -> CostModel:
    job = load(config, [f"train.precision={precision}"])
    return CostModel(Workload.from_job(job), load_cluster("h100-80gb").view(8))


def _precisions(cost: CostModel, tp: int) -> dict[str, set[str]]:
    """The precision of every matmul and attention kernel the cost model times for a layer, and for the
    last stage's extras (output layer)."""
    seen: dict[str, set[str]] = {"gemm": set(), "attention": set()}
    device = cost.dev

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(device, name)

        def gemm_time(self, m: float, n: float, k: float, precision: str, **kw: object) -> float:
            seen["gemm"].add((n, k, precision))
            return device.gemm_time(m, n, k, precision, **kw)

        def attention_time(self, flops: float, precision: str) -> float:
            seen["attention"].add(precision)
            return device.attention_time(flops, precision)

    cost.dev = Recording()
    try:
        cost._layer_costs(tp, 1, False, "none")
        cost._extras(tp, 1, False, 1, 1)
    finally:
        cost.dev = device
    return seen


def test_fp8_times_the_block_linears_at_the_float8_rate_and_the_rest_in_bf16() -> None:
    cost = _cost("fp8")
    m = cost.w.model
    seen = _precisions(cost, 2)
    assert seen["attention"] == {"bf16"}
    h, f = m.hidden_size, m.ffn_size // 2
    by_shape = {(n, k): p for n, k, p in seen["gemm"]}
    assert by_shape[(2 * f, h)] == "fp8" and by_shape[(h, f)] == "fp8"  # gate_up and down
    assert by_shape[(m.vocab_size / 2, h)] == "bf16"  # the output layer


def test_fp8_layer_is_faster_than_bf16_at_3b_but_pays_its_casts() -> None:
    fp8, bf16 = _cost("fp8"), _cost("bf16")
    a, b = fp8._layer_costs(1, 1, False, "none"), bf16._layer_costs(1, 1, False, "none")
    assert a.fwd < b.fwd and a.bwd < b.bwd
    # Hand count at tp=1 for LLaMA 3B (one sequence a micro-batch): q, k, v, o and the fused gate-up and down
    # projections; each casts input and weight forward, and output gradient twice, weight and input
    # backward, at 5 bytes an element (amax read, cast read, float8 write).
    m, tok = fp8.w.model, fp8.w.seq
    h, d, f = m.hidden_size, m.head_size, m.ffn_size
    linears = [
        (h, m.num_attention_heads * d),
        (h, m.kv_heads * d),
        (h, m.kv_heads * d),
        (m.num_attention_heads * d, h),
        (h, 2 * f),
        (f, h),
    ]
    fwd = 5 * sum(tok * i + i * o for i, o in linears)
    bwd = 5 * sum(2 * tok * o + i * o + tok * i for i, o in linears)
    assert fp8._float8_cast_bytes(1, tok) == (fwd, bwd)
