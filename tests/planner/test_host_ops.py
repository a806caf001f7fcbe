"""Operators per layer (llmtrain.planner.host_ops) against what the real blocks dispatch, and how the cost
model charges their host time: added to the compute on a CPU, hidden behind it on an accelerator."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llmtrain.config import load
from llmtrain.models.causal_lm import build
from llmtrain.planner import Workload, load_cluster
from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost.host_ops import BLOCK_OPS, ce_passes, extra_ops, layer_ops, reference_bytes
from llmtrain.planner.cost.layout import Layout, Software
from llmtrain.planner.cost.memory import edges_vocab_sharded
from llmtrain.planner.cost.model import CostModel

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.seq_length=16", "model.vocab_size=256"]


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _dispatched(fn) -> int:  # noqa: ANN001
    with _Count() as count:
        fn()
    return count.ops


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_operator_counts_are_what_the_reference_blocks_and_the_model_dispatch(arch):
    job = load("configs/llama-small.yaml", [*SMALL, f"model.arch={arch}", "model.kernels=torch"])
    torch.manual_seed(0)
    model = build(job.model).train()
    x = torch.randn(2, 16, 64, requires_grad=True)
    rope = model.rope(16)
    out = []
    fwd = _dispatched(lambda: out.append(model.layers[0](x, rope)))
    bwd = _dispatched(lambda: out[0].sum().backward())
    # The backward's count includes the seed gradient (ones_like) and the sum's expand: one each.
    sum_ops = _dispatched(lambda: out[0].sum())
    assert (fwd, bwd - 1 - sum_ops) == BLOCK_OPS[arch != "gpt"]
    assert layer_ops(job.model, C.PassComms(), "none") == BLOCK_OPS[arch != "gpt"]
    ids = torch.randint(0, 256, (2, 16))
    model(ids, ids).backward()  # warm: the rotary tables are cached after the first step
    loss = []
    whole_f = _dispatched(lambda: loss.append(model(ids, ids)))
    whole_b = _dispatched(lambda: loss[0].backward())
    layers = job.model.num_layers
    assert (whole_f - layers * fwd, whole_b - layers * (bwd - 1 - sum_ops)) == extra_ops(job.model)


_VIEWS = {
    "view",
    "t",
    "transpose",
    "unsqueeze",
    "slice",
    "split",
    "expand",
    "detach",
    "_unsafe_view",
    "alias",
}


class _Bytes(TorchDispatchMode):
    """Bytes in and out of every memory-bound operator (not views, matmuls or the fused attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in _VIEWS | {"mm", "addmm", "ones_like"} and "scaled_dot_product" not in name:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("shape", [(256, 8, 4, None), (96, 6, 2, 200)])
def test_reference_bytes_are_what_the_torch_ops_of_a_block_move(arch, shape):
    h, heads, kv, ffn = shape
    overrides = [f"model.hidden_size={h}", f"model.num_attention_heads={heads}", f"model.num_kv_heads={kv}"]
    if ffn:
        overrides.append(f"model.ffn_hidden_size={ffn}")
    job = load(
        "configs/llama-small.yaml", [*SMALL[:1], *overrides, f"model.arch={arch}", "model.kernels=torch"]
    )
    block = build(job.model).train().layers[0]
    b, s = 4, 64
    x = torch.randn(b, s, h, requires_grad=True)
    rope = build(job.model).rope(s)
    with _Bytes() as fwd:
        y = block(x, rope)
    grad = torch.ones_like(y)
    with _Bytes() as bwd:
        y.backward(grad)
    predicted = reference_bytes(job.model, b * s, 1, False, 4)
    # Per-layer tensors (norm weights, rotary tables) do not scale with tokens: under 1% here.
    assert fwd.bytes == pytest.approx(predicted[0], rel=0.02)
    assert bwd.bytes == pytest.approx(predicted[1], rel=0.02)


def test_recomputation_and_collectives_add_their_operators():
    model = load("configs/llama-small.yaml", SMALL).model
    fwd, bwd = BLOCK_OPS[True]
    sp = C.tp_layer(2, 1024, True, "none")
    assert layer_ops(model, sp, "none") == (fwd + 4, bwd + 8)
    assert layer_ops(model, C.PassComms(), "full") == (fwd, bwd + fwd)
    assert layer_ops(model, C.PassComms(), "selective") == (fwd, bwd + 1)


def _evaluate(host_op_us: float, host_is_device: bool) -> float:
    workload = Workload.from_job(load("configs/llama-small.yaml", ["train.precision=fp32"]))
    view = load_cluster("a100-80gb").view(1)
    device = replace(view.device, host_op_us=host_op_us, host_is_device=host_is_device)
    model = CostModel(workload, replace(view, device=device))
    return model._layer(1, 1, False, "none").fwd


def test_host_time_adds_on_a_cpu_and_hides_behind_an_accelerators_kernels():
    base = _evaluate(0.0, False)
    ops = BLOCK_OPS[True][0]
    assert _evaluate(2.0, True) == pytest.approx(base + ops * 2e-6)
    quick = 0.5 * base / ops * 1e6  # the host issues the layer in half its compute time: hidden
    assert _evaluate(quick, False) == base
    slow = 2 * base / ops * 1e6  # twice the compute time: the host sets the pace
    assert _evaluate(slow, False) == pytest.approx(ops * slow * 1e-6)


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_host_time_is_charged_per_collective_the_step_issues(zero):
    workload = Workload.from_job(load("configs/llama-small.yaml", ["train.precision=fp32"]))
    view = load_cluster("a100-80gb").view(2)
    layout = Layout(dp=2, micro_batch=4, zero_stage=zero)
    costs = []
    for us in (0.0, 100.0):
        device = replace(view.device, fsdp_call_us=us)
        costs.append(CostModel(workload, replace(view, device=device)).evaluate(layout).dp_exposed)
    issued = CostModel(workload, view).collectives(layout)
    calls = sum(n for c, n in issued.items() if c.group == "dp" and c.op in ("all_gather", "reduce_scatter"))
    # Not FSDP's: the vocabulary-sharded embedding's and head's own gathers and scatters, per micro-batch.
    assert edges_vocab_sharded(layout, workload.model)
    emb, head = C.vocab_sharded_edges(2, 1, 1)
    num_micro = workload.global_batch // (layout.dp * layout.micro_batch)
    calls -= num_micro * sum(c.op != "all_reduce" for c in emb.fwd + emb.bwd + head.fwd + head.bwd)
    assert costs[1] - costs[0] == pytest.approx(calls * 100e-6)


def test_the_reference_cross_entropy_makes_the_passes_ce_passes_counts():
    import kernels

    class _LossBytes(_Bytes):
        """_Bytes, but the NLL loss and its gradient read or write one element per row of the logits (the
        label's): only their outputs count, the gradient's being its zero fill."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.__name__.startswith("nll_loss"):
                return super().__torch_dispatch__(func, types, args, kwargs)
            out = func(*args, **(kwargs or {}))
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0])
            return out

    rows, vocab = 64, 512
    logits = torch.randn(rows, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))
    with _LossBytes() as fwd:
        loss = kernels.cross_entropy(logits, labels, impl="torch")
    with _LossBytes() as bwd:
        loss.backward()
    passes = ce_passes(fused=False, vocab_parallel=False)
    # Per-row tensors (labels, the loss's reduction) are under 1% of the logits' passes here.
    nbytes = 4 * rows * vocab
    assert fwd.bytes == pytest.approx(passes[0] * nbytes, rel=0.02)
    assert bwd.bytes == pytest.approx(passes[1] * nbytes, rel=0.02)


def test_the_calibrated_block_moves_the_bytes_the_cost_model_charges():
    # The memory table's rate is the bytes _OperatorClock counts over their time; the cost model divides
    # reference_bytes by it: the two counts must agree.
    from llmtrain.config.schema import ModelConfig
    from llmtrain.planner.calibration.compute import MEMORY_BLOCK, _OperatorClock

    tokens, seq = 256, 128
    cfg = ModelConfig(**MEMORY_BLOCK, num_layers=1, vocab_size=256, seq_length=seq, kernels="torch")
    model = build(cfg).train()
    x = torch.randn(tokens // seq, seq, cfg.hidden_size, requires_grad=True)
    grad, rope = torch.ones_like(x), model.rope(seq)
    clock = _OperatorClock("cpu")
    with clock.mode:
        model.layers[0](x, rope).backward(grad)
    assert clock.seconds > 0
    assert clock.moved == pytest.approx(sum(reference_bytes(cfg, tokens, 1, False, 4)), rel=0.02)


def _with_memory_table(table: dict, fused: bool) -> CostModel:
    workload = Workload.from_job(load("configs/llama-small.yaml", ["train.precision=fp32"]))
    view = load_cluster("a100-80gb").view(1)
    device = replace(view.device, memory_table=table)
    return CostModel(workload, replace(view, device=device), Software(fused_kernels=fused))


def test_the_reference_path_runs_at_the_measured_memory_rates_and_the_fused_one_ignores_them():
    model = load("configs/llama-small.yaml", ["train.precision=fp32"]).model
    b, tokens, vocab = 2, 2 * model.seq_length, model.vocab_size
    passes = ce_passes(fused=False, vocab_parallel=False)
    costs = {}
    for gbs in (10.0, 20.0):
        table = {"elementwise": [[1, gbs]], "softmax": [[1, gbs / 2]]}
        cost = _with_memory_table(table, fused=False)
        costs[gbs] = (cost._layer(1, b, False, "none").fwd, cost._extras(1, b, False)[1].bwd)
    # Halving the rate adds the bytes over the faster rate: the reference bytes, the CE's passes.
    ref_f = reference_bytes(model, tokens, 1, False, 4)[0]
    assert costs[10.0][0] - costs[20.0][0] == pytest.approx(ref_f / 20e9)
    # The last stage's backward: the CE's passes over the logits (softmax), the final norm's twice 2 passes.
    ce, norm = passes[1] * 4 * tokens * vocab / 10e9, 2 * 2 * 4 * tokens * model.hidden_size / 20e9
    assert costs[10.0][1] - costs[20.0][1] == pytest.approx(ce + norm)
    fused = [_with_memory_table({"elementwise": [[1, gbs]]}, True) for gbs in (1.0, 2.0)]
    assert fused[0]._layer(1, b, False, "none") == fused[1]._layer(1, b, False, "none")


def test_each_micro_batch_adds_its_gradients_into_the_buffer_unless_the_matmuls_accumulate():
    workload = Workload.from_job(load("configs/llama-small.yaml", ["train.precision=fp32"]))
    view = load_cluster("a100-80gb").view(1)
    layout = Layout(micro_batch=4)
    steps = [
        CostModel(workload, view, Software(grad_accumulation_fusion=fused)).evaluate(layout).step_time
        for fused in (False, True)
    ]
    # fp32: read the buffer and the new gradient, write the buffer, 4 bytes each, per micro-batch.
    params = CostModel(workload, view).params.total
    num_micro = workload.global_batch // layout.micro_batch
    added = num_micro * view.device.memory_time(3 * 4 * params)
    assert steps[0] - steps[1] == pytest.approx(added, rel=1e-6)
