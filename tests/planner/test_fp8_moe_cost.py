"""The cost model under fp8 where the runtime's choices change the GEMMs: the routed experts' grouped GEMM
(train.fp8_grouped_mm), the linears train.fp8_filter=auto keeps bf16 (engine_rules.small_gemm, what
llmtrain.parallel.float8 applies), and the float8 all-gather's scale all-reduce in the step time.
Reference: the runtime's own rules and hand counts of the casts."""

from __future__ import annotations

from llmtrain.config import load
from llmtrain.config.engine_rules import small_gemm
from llmtrain.planner import CostModel, Workload, load_cluster
from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost.layout import layout_of_job
from tests.parallel._dist import tiny_job
from tests.planner.test_fp8_cost import _precisions


def _cost(config: str, *overrides: str) -> CostModel:
    job = load(config, ["train.precision=fp8", *overrides])
    return CostModel(Workload.from_job(job), load_cluster("h100-80gb").view(8))


def test_experts_grouped_gemm_runs_at_the_float8_rate_with_its_casts_where_the_runtime_runs_it() -> None:
    on = _cost("configs/mixtral-8x7b.yaml")  # auto on an H100: torchao's rowwise grouped GEMM
    off = _cost("configs/mixtral-8x7b.yaml", "train.fp8_grouped_mm=bf16")
    m = on.w.model
    h, fe = m.hidden_size, m.expert_ffn_size
    # The experts' two GEMMs (Mixtral's dense MLP, which its layers do not use, has their shapes in fp8).
    experts_bf16 = {(2 * fe, h, "bf16"), (h, fe, "bf16")}
    assert not experts_bf16 & _precisions(on, 1)["gemm"]
    assert experts_bf16 <= _precisions(off, 1)["gemm"]
    # The matmul seconds fall; the whole layer is faster only where the weights' casts (every local
    # expert's, each micro-batch) are spread over enough rows: not with all 8 experts on one sequence's
    # rank, yes at ep=8 (one expert a rank) with 4 sequences.
    a, b = on._layer_costs(1, 1, False, "none"), off._layer_costs(1, 1, False, "none")
    assert a.wgrad < b.wgrad and a.fwd > b.fwd
    a, b = on._layer_costs(1, 4, False, "none", ep=8, dp=8), off._layer_costs(1, 4, False, "none", ep=8, dp=8)
    assert a.fwd < b.fwd and a.bwd < b.bwd
    # The casts the float8 grouped GEMMs add (5 bytes an element, as the linears'): the routed rows and
    # the outputs' gradients, and every local expert's weights, once forward and once backward.
    tok = on.w.seq
    rows = C.routed_rows(tok, m.num_experts_per_tok, 1) * on.sw.moe_imbalance
    weights = m.num_experts * 3 * h * fe
    fwd = 5 * (rows * (h + fe) + weights)
    bwd = 5 * (2 * rows * (2 * fe + h) + weights + rows * (h + fe))
    (fa, ba), (fb, bb) = on._float8_cast_bytes(1, tok), off._float8_cast_bytes(1, tok)
    assert (fa - fb, ba - bb) == (fwd, bwd)


def test_fp8_filter_auto_times_and_counts_the_linears_the_runtime_keeps_in_bf16() -> None:
    auto = _cost("configs/llama-3b.yaml", "train.fp8_filter=auto")
    every = _cost("configs/llama-3b.yaml")
    m = auto.w.model
    h, kv = m.hidden_size, m.kv_heads * m.head_size
    assert small_gemm("tensorwise", kv, h)  # LLaMA 3B's k and v projections: 1024 x 3072
    assert not small_gemm("tensorwise", 2 * m.ffn_size, h)
    by_shape = {(n, k): p for n, k, p in _precisions(auto, 1)["gemm"]}
    assert by_shape[(kv, h)] == "bf16" and by_shape[(2 * m.ffn_size, h)] == "fp8"
    # Their casts and their float8 all-gather weights are gone: 6 float8 linears a layer become 4.
    tok = auto.w.seq
    skipped = 2 * (5 * (tok * h + h * kv), 5 * (2 * tok * kv + h * kv + tok * h))
    (fa, ba), (fe, be) = auto._float8_cast_bytes(1, tok), every._float8_cast_bytes(1, tok)
    assert (fe - fa, be - ba) == (skipped[0] + skipped[2], skipped[1] + skipped[3])
    assert auto.float8_layers[0] == (4, every.float8_layers[0][1] - 2 * h * kv)


def test_float8_all_gather_scale_all_reduce_is_in_the_step_time() -> None:
    job = tiny_job("llama", precision="fp8", dp=2, zero_stage=3)
    cost = CostModel(Workload.from_job(job), load_cluster("h100-80gb").view(2))
    layout = layout_of_job(job, 2)
    assert cost.float8_gathered(layout)
    calls: list[tuple[float, int]] = []
    cluster = cost.c

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(cluster, name)

        def all_reduce(self, nbytes: float, size: int, stride: int = 1) -> float:
            calls.append((nbytes, size))
            return cluster.all_reduce(nbytes, size, stride)

    cost.c = Recording()
    try:
        comm, exposed, _ = cost._data_parallel_time(layout, 4, 1e-3, 2e-3)
    finally:
        cost.c = cluster
    scales = job.model.num_layers * 6 * C.FLOAT8_SCALE_BYTES  # 6 float8 linears a layer, an fp32 amax each
    assert (scales, 2) in calls
    assert exposed >= cluster.all_reduce(scales, 2)
