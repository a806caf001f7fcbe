"""Mixed precision, loss scaling, ZeRO-1 memory, dropout RNG under TP, recomputation and activation memory.

One gloo group of 2 processes runs every check (spawning costs more than the checks); the tests assert on
its results. References: torch's own modules (dropout on identical inputs), the run without recomputation,
the tp=1 run, Korthikanti et al. 2022's activation formula.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from llmtrain import models
from llmtrain.parallel import Topology, apply_recompute, apply_tp, build_optimizer, grad_sync, parallelize
from llmtrain.parallel.memory import korthikanti_bytes, measure_layer_bytes
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job

BF16_STEPS = 20
# bf16 keeps 8 mantissa bits: the tp=2 and tp=1 curves start equal (1e-4) and drift apart by rounding
# only. At lr 1e-2 over 20 steps the largest per-step gap depends on the trajectory: measured 2.5-7.3%
# over train.seed in {1234, 1, 2, 3} under two initialisations (the first 5% bound held for one seed
# only), so we allow 10%; the first step (1e-3) and its gradient norm (1e-2) are the sharp checks.
BF16_TOLERANCE = 1e-1


def _gather(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


def _bf16(rank: int, world: int) -> dict:
    job = tiny_job("llama", tp=2, sequence_parallel=True, precision="bf16")
    job.train.global_batch_size = 4
    data = batches(job, BF16_STEPS, learnable=True)
    run = parallel_run(job, Topology(job.parallel, world, rank), data, lr=1e-2)
    model, opt = run["model"], run["opt"]
    dtypes = {
        "param": next(model.parameters()).dtype,
        "main_grad": next(model.parameters()).main_grad.dtype,
        "master": opt.masters[0].dtype,
    }
    single = None
    if rank == 0:
        job1 = tiny_job("llama", precision="bf16")
        job1.train.global_batch_size = 4
        single = _curves(parallel_run(job1, Topology.single(), data, lr=1e-2))
    return {"tp2": _curves(run), "tp1": single, "dtypes": dtypes}


def _curves(run: dict) -> dict:
    return {"losses": run["losses"], "grad_norms": run["grad_norms"]}


def _fp16(rank: int, world: int) -> dict:
    job = tiny_job("ernie", tp=2, precision="fp16")
    topo = Topology(job.parallel, world, rank)
    torch.manual_seed(job.train.seed)
    model = models.build(job.model)
    parallelize(model, topo, job)
    opt = build_optimizer(model, topo, job)
    target = model.layers[0].mlp.gate_up_proj.weight  # TP-sharded: no collective spreads the inf for us
    poison = {"on": False}
    target.register_hook(lambda g: g * math.inf if poison["on"] else g)
    records = []
    for step, batch in enumerate(batches(job, 4)):
        poison["on"] = rank == 1 and step == 1
        before = model.layers[1].attn.q_proj.weight.detach().clone()
        opt.zero_grad()
        opt.backward(model(batch[:, :-1], batch[:, 1:]))
        local_finite = bool(torch.isfinite(opt.buffers.grad_buffer).all())
        stats = opt.step(1e-3)
        changed = not torch.equal(before, model.layers[1].attn.q_proj.weight)
        records.append(
            (stats.skipped, stats.loss_scale, local_finite, changed, math.isfinite(stats.grad_norm))
        )
    return {"records": records, "final_scale": opt.loss_scale}


def _zero_memory(rank: int, world: int) -> dict:
    out = {}
    for precision in ("fp32", "bf16"):
        for zero in (0, 1):
            job = tiny_job("gpt", dp=2, zero_stage=zero, precision=precision)
            run = parallel_run(job, Topology(job.parallel, world, rank), batches(job, 1))
            out[(precision, zero)] = run["opt"].state_bytes()
    return out


def _dropout_rng(rank: int, world: int) -> dict:
    out = {}
    for sp in (False, True):
        job = tiny_job("gpt", tp=2, sequence_parallel=sp)
        job.model.hidden_dropout = job.model.attention_dropout = 0.5
        topo = Topology(job.parallel, world, rank)
        torch.manual_seed(0)
        model = models.build(job.model)
        apply_tp(model, topo, sp, job.train.seed)
        model.train()
        torch.manual_seed(1)  # identical default stream on both ranks, as the trainer seeds it
        x = torch.ones(2, 8, 64)
        q = torch.ones(2, 2, 8, 16)
        hidden = model.layers[0].dropout(x)
        attn = model.layers[0].attn.core(q, q, q)
        out[sp] = {
            "hidden_same": torch.equal(*_gather(hidden)),
            "attn_same": torch.equal(*_gather(attn)),
        }
    return out


def _recompute_grads(rank: int, world: int) -> dict:
    """Loss and gradients with dropout on, under TP+SP, for each recompute mode from the same RNG state."""
    out = {}
    for mode in ("none", "selective", "full"):
        job = tiny_job("gpt", tp=2, sequence_parallel=True, recompute=mode)
        job.model.hidden_dropout = job.model.attention_dropout = 0.2
        topo = Topology(job.parallel, world, rank)
        torch.manual_seed(0)
        model = models.build(job.model)
        parallelize(model, topo, job)
        model.train()
        torch.manual_seed(5)
        batch = batches(job, 1)[0]
        with grad_sync(model, True):
            model(batch[:, :-1], batch[:, 1:]).backward()
        model.grad_buffers.finish()
        out[mode] = model.grad_buffers.grad_buffer.clone()
    return out


def _activation_table(rank: int, world: int) -> list[tuple]:
    s, b, h, a = 128, 2, 128, 4
    rows = []
    for tp, sp in ((1, False), (2, False), (2, True)):
        for mode in ("none", "selective", "full"):
            job = tiny_job("gpt", tp=tp, dp=world // tp, sequence_parallel=sp, recompute=mode)
            m = job.model
            m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 1, h, a, s
            m.hidden_dropout = m.attention_dropout = 0.1
            topo = Topology(job.parallel, world, rank)
            torch.manual_seed(0)
            model = models.build(m).to(torch.bfloat16)
            apply_tp(model, topo, sp, job.train.seed)
            apply_recompute(model, mode)
            model.train()
            measured = measure_layer_bytes(model, 0, b, s // tp if sp else s)
            rows.append((mode, tp, sp, measured, korthikanti_bytes(s, b, h, a, tp, sp, mode)))
    return rows


def _dp_communication(rank: int, world: int) -> dict:
    """Collectives per micro-step and when the buckets start, for dp=2 with several buckets."""
    out = {}
    for key, zero, overlap in ((0, 0, True), (1, 1, True), ("1 waited", 1, False)):
        job = tiny_job("gpt", dp=2, zero_stage=zero, overlap_param_gather=overlap)
        topo = Topology(job.parallel, world, rank)
        torch.manual_seed(0)
        model = models.build(job.model)
        parallelize(model, topo, job)
        buffers = model.grad_buffers
        calls = []
        launch = buffers._launch

        def counting_launch(bucket, launch=launch, calls=calls, buffers=buffers):
            # Parameters whose gradient has not arrived yet, when this bucket's reduction starts.
            calls.append(sum(b.pending for b in buffers.buckets))
            launch(bucket)

        buffers._launch = counting_launch
        opt = build_optimizer(model, topo, job)
        batch = batches(job, 1)[0][rank * 4 : rank * 4 + 4]
        opt.zero_grad()
        with grad_sync(model, False):
            opt.backward(model(batch[:2, :-1], batch[:2, 1:]))
        during_accumulation = list(calls)
        with grad_sync(model, True):
            opt.backward(model(batch[2:, :-1], batch[2:, 1:]))
        in_flight = [b.handle is not None for b in buffers.buckets]
        opt.step(1e-3)
        gathering_after_step = [b.gather_handle is not None for b in buffers.buckets]
        at_first_layer: list[bool] = []
        model.layers[0].register_forward_pre_hook(
            lambda *_, seen=at_first_layer, bs=buffers.buckets: seen.extend(
                b.gather_handle is not None for b in bs
            )
        )
        with torch.no_grad():
            loss_overlapped = model(batch[:2, :-1], batch[:2, 1:]).item()
            gathering_after_forward = [b.gather_handle is not None for b in buffers.buckets]
            loss_again = model(batch[:2, :-1], batch[:2, 1:]).item()
        tied = model.embed_tokens.weight
        out[key] = {
            "buckets": len(buffers.buckets),
            "accumulation_calls": during_accumulation,
            "sync_calls": calls[len(during_accumulation) :],
            "in_flight_before_step": in_flight,
            "gathering_after_step": gathering_after_step,
            "gathering_at_first_layer": at_first_layer,
            "gathering_after_forward": gathering_after_forward,
            "loss_overlapped_vs_whole": (loss_overlapped, loss_again),
            "tied_in_buckets": sum(any(p is tied for p in b.params) for b in buffers.buckets),
            "params_in_buckets": sum(len(b.params) for b in buffers.buckets),
            "unique_params": len({id(p) for p in model.parameters()}),
        }
    return out


def _all(rank: int, world: int) -> dict:
    return {
        "dp_comm": _dp_communication(rank, world),
        "bf16": _bf16(rank, world),
        "fp16": _fp16(rank, world),
        "zero": _zero_memory(rank, world),
        "dropout": _dropout_rng(rank, world),
        "recompute": _recompute_grads(rank, world),
        "activations": _activation_table(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(2, _all)


@pytest.mark.slow
def test_bf16_tp2_follows_tp1(results: list[dict]) -> None:
    r = results[0]["bf16"]
    assert r["dtypes"] == {"param": torch.bfloat16, "main_grad": torch.float32, "master": torch.float32}
    tp2, tp1 = r["tp2"]["losses"], r["tp1"]["losses"]
    rel = [abs(a - b) / b for a, b in zip(tp2, tp1, strict=True)]
    assert max(rel) < BF16_TOLERANCE, (tp2, tp1)
    assert abs(tp2[0] - tp1[0]) / tp1[0] < 1e-3
    assert tp2[-1] < tp2[0] - 1.0  # a curve that moves, not a flat line
    # The first step's gradients come from the same weights and differ by bf16 rounding only (a few units
    # of 2**-9 through two layers); later norms follow the curves apart (bf16 at lr 1e-2 is chaotic).
    norm2, norm1 = r["tp2"]["grad_norms"][0], r["tp1"]["grad_norms"][0]
    assert abs(norm2 - norm1) / norm1 < 1e-2, (norm2, norm1)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_everywhere(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        skipped, scales, finite, changed, norm_finite = zip(*res["fp16"]["records"], strict=True)
        assert skipped == (False, True, False, False), rank
        assert changed == (True, False, True, True), rank
        assert scales[1] == scales[0] and scales[2] == scales[1] / 2, rank
        assert not norm_finite[1] and norm_finite[2], rank
    # Only rank 1 produced the overflow: rank 0's own gradients were finite when it decided to skip.
    assert results[0]["fp16"]["records"][1][2] and not results[1]["fp16"]["records"][1][2]


@pytest.mark.slow
def test_zero1_shards_optimizer_state(results: list[dict]) -> None:
    for rank_result in results:
        z = rank_result["zero"]
        for precision in ("fp32", "bf16"):
            ratio = z[(precision, 1)] / z[(precision, 0)]
            assert abs(ratio - 0.5) / 0.5 < 0.05, (precision, ratio)
        # bf16 adds the fp32 master copy to Adam's two states: 12 vs 8 bytes per parameter.
        assert z[("bf16", 0)] / z[("fp32", 0)] == pytest.approx(1.5)


@pytest.mark.slow
def test_dp_reduces_buckets_during_backward_and_not_on_accumulation(results: list[dict]) -> None:
    for zero in (0, 1):
        r = results[0]["dp_comm"][zero]
        assert r["buckets"] > 2
        assert r["accumulation_calls"] == []  # no communication on the accumulation micro-step
        assert len(r["sync_calls"]) == r["buckets"]  # every bucket reduced once
        # The first reduction starts while gradients are still outstanding: it overlaps backward.
        assert r["sync_calls"][0] > 0 and r["sync_calls"] == sorted(r["sync_calls"], reverse=True)
        assert all(r["in_flight_before_step"])
        # The tied embedding / LM-head weight is one parameter in one bucket: reduced once.
        assert r["tied_in_buckets"] == 1 and r["params_in_buckets"] == r["unique_params"]
        assert not any(r["gathering_after_forward"])
        assert r["loss_overlapped_vs_whole"][0] == r["loss_overlapped_vs_whole"][1]


@pytest.mark.slow
def test_zero1_parameter_gather_overlaps_the_next_forward(results: list[dict]) -> None:
    for rank_result in results:
        z0, z1 = rank_result["dp_comm"][0], rank_result["dp_comm"][1]
        assert not any(z0["gathering_after_step"])  # zero_stage 0 has nothing to gather
        assert all(z1["gathering_after_step"])  # every bucket's gather left in flight by the step
        # When the first layer starts, only the buckets it and the embedding need have been waited for:
        # the buckets of the later layers (first in the buffer) are still gathering behind its compute.
        pending = z1["gathering_at_first_layer"]
        assert pending[0] and not pending[-1], pending
        # Without the overlap the step waits for every gather itself; the parameters come out the same.
        waited = rank_result["dp_comm"]["1 waited"]
        assert not any(waited["gathering_after_step"])
        assert waited["loss_overlapped_vs_whole"] == z1["loss_overlapped_vs_whole"]


@pytest.mark.slow
def test_dropout_streams_under_tp(results: list[dict]) -> None:
    d = results[0]["dropout"]
    # Replicated activations (no SP): same mask on every TP rank. Sharded ones (SP, head shards): different.
    assert d[False]["hidden_same"] and not d[True]["hidden_same"]
    assert not d[False]["attn_same"] and not d[True]["attn_same"]


@pytest.mark.slow
def test_recompute_gives_identical_gradients_with_dropout_under_tp_sp(results: list[dict]) -> None:
    for res in results:
        g = res["recompute"]
        assert g["none"].abs().sum() > 0
        torch.testing.assert_close(g["selective"], g["none"], rtol=0, atol=1e-6)
        torch.testing.assert_close(g["full"], g["none"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_activation_memory_vs_korthikanti(results: list[dict]) -> None:
    rows = results[0]["activations"]
    print("\nsaved activations per layer, gpt s=128 b=2 h=128 a=4 bf16, dropout on (rank 0)")
    print(f"{'recompute':>10} {'tp':>3} {'sp':>5} {'measured':>10} {'formula':>10} {'ratio':>6}")
    for mode, tp, sp, measured, formula in rows:
        print(f"{mode:>10} {tp:>3} {sp!s:>5} {measured:>10} {formula:>10.0f} {measured / formula:>6.2f}")
    ratio = {(mode, tp, sp): measured / formula for mode, tp, sp, measured, formula in rows}
    # Full recomputation keeps exactly the layer input, as the formula says.
    for key in (("full", 1, False), ("full", 2, False), ("full", 2, True)):
        assert ratio[key] == pytest.approx(1.0), key
    # Outside the attention core our layer stores what the formula counts (within norm statistics).
    for key in (("selective", 1, False), ("selective", 2, False), ("selective", 2, True)):
        assert 0.95 < ratio[key] < 1.15, key
    # SP divides everything by t: measured TP+SP / no-TP matches 1/t closely.
    measured = {(mode, tp, sp): m for mode, tp, sp, m, _ in rows}
    assert measured[("selective", 2, True)] / measured[("selective", 1, False)] == pytest.approx(
        0.5, rel=0.05
    )


def test_impossible_tp_split_is_rejected() -> None:
    from llmtrain.config import ConfigError
    from llmtrain.parallel.tensor_parallel import check_tp

    job = tiny_job("llama")
    with pytest.raises(ConfigError, match="num_attention_heads"):
        check_tp(job.model, 3, False)
    job.model.num_attention_heads, job.model.num_kv_heads, job.model.hidden_size = 12, 4, 96
    with pytest.raises(ConfigError, match="num_kv_heads"):
        check_tp(job.model, 6, False)
    with pytest.raises(ConfigError, match="seq_length"):
        job.model.seq_length = 18
        check_tp(job.model, 4, True)
