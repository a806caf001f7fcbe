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


def test_compiled_float8_fuses_each_activations_amax_and_casts_it_once() -> None:
    from dataclasses import replace

    from llmtrain.planner import Software

    # torchao's tensorwise scaling under torch.compile (Software.compiled_float8, torchtitan's compiled float8
    # rows): an activation's amax is reduced in the kernel producing it, and one pass reads it (2 bytes an
    # element) and writes its float8 copy in both layouts (1 + 1): the input forward, the output gradient
    # backward, 4 bytes each; a weight keeps its amax read (2) and is cast forward and backward (3 each).
    eager = _cost("fp8")
    cluster = load_cluster("h100-80gb").view(8)
    compiled = CostModel(eager.w, cluster, Software(compiled_float8=True))
    m, tok = eager.w.model, eager.w.seq
    h, d, f = m.hidden_size, m.head_size, m.ffn_size
    q, kv = m.num_attention_heads * d, m.kv_heads * d
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, 2 * f), (f, h)]
    fwd = sum(4 * tok * i + 5 * i * o for i, o in linears)
    bwd = sum(4 * tok * o + 3 * i * o for i, o in linears)
    assert compiled._float8_cast_bytes(1, tok) == (fwd, bwd)
    # Per linear 16 bytes per element of input, weight and output gradient against eager's 30: the layer
    # is faster, its matmuls unchanged; llmtrain's own software (the default) keeps the eager casts.
    assert not Software().compiled_float8
    a, b = compiled._layer_costs(1, 1, False, "none"), eager._layer_costs(1, 1, False, "none")
    assert a.fwd < b.fwd and a.bwd < b.bwd and a.wgrad == b.wgrad
    # Only tensorwise scaling: torchao's rowwise recipe keeps the eager count.
    rowwise = replace(eager.w, fp8_recipe="rowwise")
    assert CostModel(rowwise, cluster, Software(compiled_float8=True))._float8_cast_bytes(
        1, tok
    ) == CostModel(rowwise, cluster)._float8_cast_bytes(1, tok)
