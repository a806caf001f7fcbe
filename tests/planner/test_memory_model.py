"""The per-rank memory model (llmtrain.planner.memory) against hand-derived bytes, the 70B case, and the
search's fit decisions (steady state and startup peak both under the device's capacity)."""

from dataclasses import replace
from pathlib import Path

import pytest

from llmtrain.config import load
from llmtrain.config.schema import ModelConfig
from llmtrain.pipeline.partition import partition_layers
from llmtrain.pipeline.schedules import build_schedule
from llmtrain.planner import Software, Workload, load_cluster, plan, plan_job
from llmtrain.planner.auto import layout_overrides
from llmtrain.planner.cost.flops import head_cost_in_layers, parameter_counts
from llmtrain.planner.cost.layout import Layout, with_layout
from llmtrain.planner.cost.memory import (
    p2p_transfers_held,
    pending_weight_grads,
    rank_memory,
    shard_group,
    sharding_problem,
)
from llmtrain.planner.cost.model import CostModel
from llmtrain.planner.cost.pipeline_time import peak_inflight_closed

GIB = 2**30
CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# A tiny LLaMA: h=64, 4 heads of 16 (no GQA), gated MLP of 128, vocab 256, 4 layers, 32 tokens, untied.
TINY = ModelConfig(
    arch="llama",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=32,
    tie_word_embeddings=False,
)
PER_LAYER = 64 * (4 + 2 * 4) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64  # qkv + out + gate/up/down + 2 norms
EMBEDDING = HEAD = 256 * 64
TOTAL = 4 * PER_LAYER + EMBEDDING + HEAD + 64  # + final norm
P = TOTAL // 2  # per rank at tp=2, pp=1 (everything is split over TP in this count)
LARGEST = PER_LAYER // 2  # the largest block per TP rank: a layer (41088 > 16384 embedding parameters)


def tiny(layout: Layout, software: Software | None = None, precision: str = "bf16", num_micro: int = 4):
    return rank_memory(
        TINY,
        precision,
        layout,
        software or Software(),
        inflight=1,
        num_micro=num_micro,
        reserved_bytes=0.0,
    )


def test_hand_count_of_parameters():
    assert (PER_LAYER, TOTAL) == (41088, 197184)
    counts = parameter_counts(TINY)
    assert (counts.per_layer, counts.total) == (PER_LAYER, TOTAL)


def test_zero3_components_by_hand():
    """tp=2, pp=1, dp=4, zero 3, bf16, micro-batch 1 of 32 tokens, full recompute, no SP.

    State (N = dp = 4, P = 197184 / 2 = 98592 parameters per TP rank): the fp32 shard 4P/4 = P bytes, Adam's
    two fp32 moments 8P/4 = 2P; gradients at the peak (the backward's start): over 4 micro-batches the
    earlier ones' gradients reduce-scattered into the fp32 shards (4P/4 = P), or with grad_reduce=step kept
    unsharded in fp32 (4P; benchmarks/bench_memory.py's dp2-zero3 and dp2-zero3-step rows differ by them but
    for the vocabulary-sharded edges), over one there are none yet (zero_grad dropped the shards).
    Over one micro-batch with full recompute the later moment is the peak, the first block's backward: all
    the fp32 gradient shards (4P/4 = P) and only that block's recomputed activations, fewer than the
    start's (measured on llama-0.5b, README: 1.155 GiB against 1.138 predicted).
    Gathered: the largest block is a layer, 41088 / 2 = 20544 parameters per TP rank; the computing block and
    the prefetched next layer in bf16 (2 x 2 x 20544) plus one block's unsharded fp32 gradient (4 x 20544).
    Activations (full recompute): each of the 4 layers keeps its bf16 input, 2 x 32 x 64 = 4096 bytes, the
    embedding output another 4096, and the logits 32 x 256 / 2 = 4096 elements in bf16 and fp32 (6 bytes):
    4 x 4096 + 4096 + 24576 = 45056.
    Buffers: none (no pipeline sends at pp=1; TP all-reduces and FSDP reduce-scatters work in place).
    Startup with sharded construction: FSDP2 shards the meta model, so the rank allocates its fp32 shard
    (4P/4 = P) and, on top, at most one initialisation block drawn whole (the largest tensor, 20544 elements
    in fp32, is smaller than a block of 2**20); without it: the whole model in fp32 (4 x 197184) and the
    rank's fp32 TP slice cut from it (4P).
    """
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=1, recompute="full", zero_stage=3)
    mem = tiny(layout)
    assert mem.params == P and mem.grads == P and mem.optimizer == 2 * P
    assert tiny(replace(layout, grad_reduce="step")).grads == 4 * P
    one = tiny(layout, num_micro=1)
    assert one.grads == P and one.activations < mem.activations
    assert mem.gathered == 2 * 2 * LARGEST + 4 * LARGEST
    assert mem.activations == 4 * 4096 + 4096 + 24576
    assert mem.buffers == 0
    assert mem.startup == P + 4 * LARGEST
    whole = tiny(layout, Software.whole_model_init())
    assert whole.startup == 4 * TOTAL + 4 * P
    assert mem.steady == pytest.approx(4 * P + 8 * LARGEST + 45056)
    assert whole.peak == whole.startup  # whole-model construction dominates this tiny case


def test_zero_stages_hybrid_sharding_and_offload_by_hand():
    """Same shape. zero 0: 2P (bf16) + 4P (fp32 grads) + 12P (master + moments). zero 1: the 12P over dp=4.
    zero 2 with hybrid sharding over groups of 2: 2P + 12P/2, the fp32 gradient shards the 4 micro-batches
    accumulate into (4P/2; with grad_reduce=step unsharded, 4P) and one block's unsharded fp32 gradient.
    Offload at zero 3: the optimizer rows and the gradient shard (and with params the fp32 shard) leave the
    device for the host: P + 2P (+ P)."""
    base = Layout(tp=2, pp=1, dp=4, micro_batch=1, recompute="full")
    z0, z1 = tiny(base), tiny(Layout(**{**base.__dict__, "zero_stage": 1}), Software.whole_model_init())
    assert (z0.params, z0.grads, z0.optimizer) == (2 * P, 4 * P, 12 * P)
    assert (z1.params, z1.grads, z1.optimizer) == (2 * P, 4 * P, 3 * P)
    # Startup: the whole fp32 model and the TP slice (4 x 2P + 4P), then the fp32 slice with the flat bf16
    # parameters, fp32 gradients and the exact fp32 initial values for the master copy (4P + 2P + 4P + 4P).
    assert z1.startup == max(4 * TOTAL + 4 * P, 14 * P) == 14 * P
    # Sharded construction: the fp32 slice alone, then the same copy into the flat buffers.
    assert tiny(Layout(**{**base.__dict__, "zero_stage": 1})).startup == 14 * P
    assert z1.buffers == 0  # NCCL reduce-scatters in place on the flat gradient buffer
    gloo = tiny(Layout(**{**base.__dict__, "zero_stage": 1}), Software(gloo_shard_exchange=True))
    # 3 peers' fp32 copies of this rank's quarter of the gradients, alive once the activations are freed
    assert gloo.buffers == 4 * P * 3 / 4 - gloo.activations
    hsdp_layout = Layout(**{**base.__dict__, "zero_stage": 2, "dp_shard": 2})
    hsdp = tiny(hsdp_layout)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer, hsdp.gathered) == (2 * P, 2 * P, 6 * P, 4 * LARGEST)
    assert tiny(replace(hsdp_layout, grad_reduce="step")).grads == 4 * P
    # A replica's CP ranks share its shards (llmtrain.parallel.fsdp): N = dp_shard x cp = 4.
    hsdp_cp = tiny(Layout(**{**base.__dict__, "zero_stage": 2, "dp_shard": 2, "cp": 2}))
    assert (hsdp_cp.params, hsdp_cp.grads, hsdp_cp.optimizer) == (2 * P, P, 3 * P)
    # Offload runs through the DeepSpeed engine (tp=1): the whole model per rank, 2P parameters.
    flat = Layout(**{**base.__dict__, "tp": 1, "zero_stage": 3, "offload": "optimizer"})
    off = tiny(flat)
    assert (off.params, off.grads, off.optimizer, off.host) == (2 * P, 0, 0, 6 * P)
    both = tiny(Layout(**{**flat.__dict__, "offload": "optimizer+params"}))
    assert (both.params, both.grads, both.optimizer, both.host) == (0, 0, 0, 8 * P)
    fp32 = tiny(Layout(**{**base.__dict__, "zero_stage": 1}), precision="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * P, 4 * P, 2 * P)  # the params are the master


def test_p2p_transfers_held_until_the_step_end_by_hand():
    """pp=2, 8 micro-batches, as traced in benchmarks/bench_memory.py's pp2 rows (memory.py's docstring).
    1f1b: the first rank sends one output per micro-batch and has 2 in flight at its peak (6 done); the last
    receives one input and sends its gradient back (2 per micro-batch), 1 in flight (7 done). Interleaved,
    2 chunks (stages 1 and 3 on the last rank): 2 inputs, their 2 gradients and 1 output per micro-batch;
    3 (micro-batch, chunk) pairs in flight, 2 micro-batches (6 done)."""
    one_f_one_b = Layout(tp=1, pp=2, dp=1, micro_batch=1)
    assert p2p_transfers_held(one_f_one_b, 8, 0) == 6 * 1
    assert p2p_transfers_held(one_f_one_b, 8, 1) == 7 * 2
    interleaved = replace(one_f_one_b, schedule="interleaved_1f1b", virtual_stages=2)
    assert p2p_transfers_held(interleaved, 8, 1) == 6 * 5
    off = tiny(interleaved)
    on = tiny(interleaved, Software(p2p_held_until_step_end=True))
    one = 2 * 32 * 64  # a bf16 activation of 32 tokens x 64
    assert on.buffers - off.buffers in (p2p_transfers_held(interleaved, 4, r) * one for r in (0, 1))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"zero_stage": 1, "dp_shard": 2}, "needs zero_stage 2 or 3"),
        ({"zero_stage": 3, "dp_shard": 3}, "must divide dp=4"),
        ({"zero_stage": 3, "dp_shard": 4}, "strictly between"),
        ({"zero_stage": 1, "offload": "optimizer"}, "needs zero_stage 2 or 3"),
        ({"zero_stage": 2, "offload": "optimizer+params"}, "needs zero_stage 3"),
        ({"zero_stage": 3, "offload": "disk"}, "offload must be one of"),
        ({"zero_stage": 3, "offload": "optimizer"}, "runs through the DeepSpeed engine"),
    ],
)
def test_impossible_sharding_is_named(changes, message):
    assert message in sharding_problem(Layout(tp=2, pp=1, dp=4, **changes))


def seventy_b():
    return load(CONFIGS / "llama3-70b.yaml")


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_70b_on_64_h100_needs_sharded_construction():
    """Built whole in fp32 on every rank first, 70.6e9 x 4 bytes = 263 GiB: no layout starts on 80 GiB."""
    result = plan_job(seventy_b(), load_cluster("h100-80gb"), 64, software=Software.whole_model_init(), top=3)
    assert not result.fitting()
    assert result.best.memory["startup"] > 263 * GIB
    assert "needs sharded construction" in result.best.why


def test_70b_on_64_h100_fits_with_zero3_and_sharded_construction():
    """With sharded construction and ZeRO-3 the parameters and Adam's state are 12 bytes per parameter over
    the shard group (dp x cp ranks); the gradients, under gradient accumulation, 4 more over it (each
    micro-batch's reduce-scattered into the fp32 shards), where grad_reduce=step would keep them unsharded
    in fp32: 4 bytes per TP/PP-local parameter, shard group / 3 times all the rest of the state."""
    result = plan_job(seventy_b(), load_cluster("h100-80gb"), 64, top=5)
    best = result.best
    assert best.fits and best.layout.zero_stage == 3
    # The startup peak is the rank's fp32 shard plus at most one init block or one more shard (FSDP2
    # shards the meta model): far below the fp32 TP-local model a whole-slice construction would hold.
    per_rank = 70.55e9 / (best.layout.tp * best.layout.pp) / shard_group(best.layout)
    tp_local = 4 * 70.55e9 / (best.layout.tp * best.layout.pp)
    assert best.memory["total"] <= 80 * GIB
    assert 4 * per_rank <= best.memory["startup"] < tp_local / 2
    # Within 5%: with pp > 1 the fullest stage holds a few % more than 1/pp of the parameters (whole layers,
    # the embedding or output layer on top; 3% at tp=4 pp=4).
    state = best.memory["params"] + best.memory["optimizer"] + best.memory["host"]
    assert state == pytest.approx(12 * per_rank, rel=0.05)
    accumulating = seventy_b().train.global_batch_size // (best.layout.dp * best.layout.micro_batch) > 1
    assert best.memory["grads"] == pytest.approx(4 * per_rank if accumulating else 0, rel=0.05)
    step = CostModel(Workload.from_job(seventy_b()), load_cluster("h100-80gb").view(64), Software())
    unsharded = step.evaluate(replace(best.layout, grad_reduce="step")).memory
    assert unsharded["grads"] == pytest.approx(tp_local if accumulating else 0, rel=0.05)


@pytest.mark.parametrize(
    ("model", "gpus", "batch", "software"),
    [
        (TINY, 8, 64, Software()),
        (
            ModelConfig(arch="gpt", num_layers=24, hidden_size=2048, num_attention_heads=16),
            16,
            256,
            Software(),
        ),
        ("70b", 64, 512, Software()),
        ("70b", 16, 64, Software()),
        ("70b", 64, 512, Software.whole_model_init()),
    ],
)
def test_search_never_calls_an_overflowing_layout_fitting(model, gpus, batch, software):
    if model == "70b":
        model = seventy_b().model
    result = plan(Workload(model, batch, "bf16"), load_cluster("h100-80gb"), gpus, software=software, top=5)
    capacity = 80 * GIB
    assert result.ranked
    for est in result.ranked:
        mem = est.memory
        assert mem["total"] == max(mem["steady"], mem["startup"])
        assert est.fits == (mem["steady"] <= capacity and mem["startup"] <= capacity)
    fitting = [e for e in result.ranked if e.fits]
    assert result.ranked[: len(fitting)] == fitting  # every fitting layout ranks above every other


def test_startup_peak_alone_makes_a_layout_not_fit():
    model = ModelConfig(arch="gpt", num_layers=48, hidden_size=6144, num_attention_heads=48)  # 22B
    work = Workload(model, 64, "bf16")
    layout = Layout(tp=8, pp=1, dp=8, micro_batch=1, recompute="full", zero_stage=1)
    view = load_cluster("h100-80gb").view(64)
    whole = CostModel(work, view, Software.whole_model_init()).evaluate(layout)
    sharded = CostModel(work, view).evaluate(layout)
    assert whole.memory["steady"] < 80 * GIB < whole.memory["startup"]
    assert not whole.fits and "startup peak" in whole.why
    assert sharded.fits


def generated_peak_inflight(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    """Most (micro-batch, chunk) pairs a rank holds, replayed from the schedule generator's actions."""
    live, peak = set(), 0
    for action in build_schedule(schedule, pp, m, v).actions[rank]:
        if action.kind == "F":
            live.add((action.microbatch, action.chunk))
        elif action.kind in ("B", "I"):  # the input gradient frees the activations (W keeps only its inputs)
            live.discard((action.microbatch, action.chunk))
        peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 16), (8, 8)])
def test_in_flight_micro_batches_of_first_and_last_rank_match_the_schedules(schedule, pp, m):
    v = 2 if schedule == "interleaved_1f1b" else 1
    for rank in (0, pp - 1):
        closed = peak_inflight_closed(schedule, pp, m, v, rank)
        assert closed == generated_peak_inflight(schedule, pp, m, v, rank)


def generated_owed_weight_grads(schedule: str, pp: int, m: int, rank: int) -> int:
    """Most weight gradients (W) a rank still owes, from earlier micro-batches, when it computes an I."""
    owed, peak = set(), 0
    for action in build_schedule(schedule, pp, m, 1).actions[rank]:
        if action.kind == "I":
            peak = max(peak, len(owed))
            owed.add(action.microbatch)
        elif action.kind == "W":
            owed.discard(action.microbatch)
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 8), (4, 2), (4, 16), (8, 8)])
def test_owed_weight_gradients_match_the_schedules(schedule, pp, m):
    for rank in range(pp):
        owed = generated_owed_weight_grads(schedule, pp, m, rank)
        assert pending_weight_grads(schedule, pp, m, rank) == owed


def test_pipeline_ranks_hold_the_trainers_flop_balanced_split():
    """With a 4096-word vocabulary the output layer costs several layers' FLOPs, so the trainer's balanced
    split (its default) puts 3 of TINY's 4 layers on the first of pp=2 stages; the even split 2 + 2. The
    startup peak (fp32, zero 0: the rank's modules, flat parameters and gradients, 12 bytes a parameter)
    of the fuller rank shows which."""
    big = replace(TINY, vocab_size=4096)
    vocab = 4096 * 64
    assert [len(r) for r in partition_layers(4, 2, head_cost=head_cost_in_layers(big))] == [3, 1]
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1)

    def startup(software: Software) -> float:
        return rank_memory(big, "fp32", layout, software, inflight=2, num_micro=4, reserved_bytes=0.0).startup

    assert startup(Software()) == 12 * (3 * PER_LAYER + vocab)
    assert startup(Software(balance_stages=False)) == 12 * (2 * PER_LAYER + vocab + 64)


def test_layouts_become_the_config_fields_the_trainer_reads():
    job = load(CONFIGS / "llama3-70b.yaml")
    hsdp = Layout(tp=4, pp=1, dp=16, micro_batch=1, zero_stage=3, dp_shard=8)
    offload = Layout(tp=1, pp=1, dp=64, micro_batch=1, zero_stage=3, offload="optimizer+params")
    assert layout_overrides(hsdp)["parallel.dp_shard"] == 8
    assert "parallel.engine" not in layout_overrides(hsdp)
    assert layout_overrides(offload)["parallel.engine"] == "deepspeed"
    assert layout_overrides(offload)["parallel.offload"] == "optimizer+params"
    written = with_layout(job, offload)
    assert (written.parallel.engine, written.parallel.offload, written.parallel.dp_shard) == (
        "deepspeed",
        "optimizer+params",
        None,
    )
    assert with_layout(job, hsdp).parallel.dp_shard == 8


def test_init_block_matches_the_initialisation():
    from llmtrain.models.init import BLOCK_NUMEL
    from llmtrain.planner.cost.memory import INIT_BLOCK_NUMEL

    assert INIT_BLOCK_NUMEL == BLOCK_NUMEL


def test_vocab_sharded_edges_are_never_gathered():
    """ZeRO-3 on 4 DP ranks, tp=pp=cp=1, untied, with a vocabulary of 4096 whose embedding (4096 x 64 =
    262144 parameters) outweighs a layer: the edges stay vocabulary-sharded (llmtrain.parallel.vocab_sharded),
    so the gathered bytes are a layer's (the computing and the prefetched one in bf16, one fp32 gradient:
    8 x PER_LAYER) and the 4 ranks' final hidden states are held (bf16: 4 x 2 x 32 x 64 = 16384 bytes more
    activations). Hybrid sharding (dp_shard=2) and tied embeddings gather them: the embedding is the
    largest."""
    wide = replace(TINY, vocab_size=4096)
    layout = Layout(dp=4, zero_stage=3)
    sharded = rank_memory(wide, "bf16", layout, Software(), inflight=1, num_micro=4, reserved_bytes=0.0)
    assert sharded.gathered == 8 * PER_LAYER
    hybrid = rank_memory(
        wide, "bf16", replace(layout, dp_shard=2), Software(), inflight=1, num_micro=4, reserved_bytes=0.0
    )
    assert hybrid.gathered == 2 * (4096 * 64 + PER_LAYER) + 4 * 4096 * 64
    assert sharded.activations - hybrid.activations == 16384
    tied = replace(wide, tie_word_embeddings=True)
    assert rank_memory(
        tied, "bf16", layout, Software(), inflight=1, num_micro=4, reserved_bytes=0.0
    ).gathered == (hybrid.gathered)


def test_mtp_modules_on_the_last_stage():
    # model.mtp_layers=1: its parameters (counts.mtp) join the last stage's and their state, with pp an
    # embedding copy too (untied: the head's copy does not serve), and one more set of logits.
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1)
    mtp = replace(TINY, mtp_layers=1)
    extra = parameter_counts(mtp).mtp
    assert extra == PER_LAYER + 2 * 64 * 64 + 3 * 64  # a layer, eh_proj, enorm, hnorm and final norm

    def last(model):
        return rank_memory(model, "fp32", layout, Software(), inflight=1, num_micro=4, reserved_bytes=0.0)

    without, with_mtp = last(TINY), last(mtp)
    assert with_mtp.params - without.params == 4 * (extra + EMBEDDING)
    assert with_mtp.activations > without.activations


def test_an_moe_mtp_blocks_routed_experts_are_divided_over_ep():
    # deepseek-v3-small's MTP block is an MoE one: its routed experts (8 gated MLPs of expert_ffn_size) join
    # the last stage's expert state, divided over ep as a layer's are; the rest of the block is not. So the
    # block adds exactly half its routed experts' bytes less at ep=2 than at ep=1 (fp32: 4 bytes a parameter).
    model = load(CONFIGS / "deepseek-v3-small.yaml").model
    routed = model.num_experts * 3 * model.hidden_size * model.expert_ffn_size

    def added_by_mtp(ep: int) -> float:
        layout = Layout(tp=1, pp=1, dp=2, micro_batch=1, ep=ep)
        with_mtp, without = (
            rank_memory(m, "fp32", layout, Software(), inflight=1, num_micro=4, reserved_bytes=0.0).params
            for m in (model, replace(model, mtp_layers=0))
        )
        return with_mtp - without

    assert added_by_mtp(1) - added_by_mtp(2) == 4 * routed / 2
