"""Context and expert parallelism in the planner: FLOPs and parameters of MoE models against transformers,
the CP/EP communication terms against hand-derived numbers, memory divided by cp and ep, and the plans that
choose them (issue 17 point 6, issue 16 point 6)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from llmtrain.config import ConfigError, ModelConfig, load
from llmtrain.config.loader import with_overrides
from llmtrain.planner import CostModel, Workload, load_cluster, parse_fixed, plan, plan_for_world, plan_job
from llmtrain.planner.auto import layout_overrides
from llmtrain.planner.cost import collectives as C
from llmtrain.planner.cost import flops as F
from llmtrain.planner.cost.layout import Layout, Software, with_layout
from llmtrain.planner.report.choices import parallelism_notes

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
plan_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_tool)

MIB = 2**20
LONG = ["model.seq_length=131072", "train.global_batch_size=128"]
"""Llama 3's long-context stage: 131,072-token sequences, 16M tokens per batch (arXiv:2407.21783, 3.4.2)."""

TINY_MOE = {
    "mixtral": {},
    "qwen3_moe": dict(moe_ffn_hidden_size=48),
    "deepseek_v3": dict(
        num_kv_heads=None, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, moe_ffn_hidden_size=48, num_shared_experts=1, moe_layer_start=1,
    ),
}  # fmt: skip


def _tiny_moe(arch: str) -> ModelConfig:
    base = dict(
        arch=arch, num_layers=3, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
        num_experts=4, num_experts_per_tok=2, vocab_size=128, seq_length=16,
    )  # fmt: skip
    return ModelConfig(**{**base, **TINY_MOE[arch]})


@pytest.mark.slow  # imports transformers (~10 s on a loaded CPU)
@pytest.mark.parametrize("arch", sorted(TINY_MOE))
def test_moe_flops_count_the_active_experts_of_the_transformers_model(arch: str) -> None:
    # torch's FLOP counter over transformers' forward with its eager experts (a loop over the experts the
    # tokens were routed to): only the top-k experts' matmuls run, plus router, attention (the full s x s
    # square, as eager attention computes it; deepseek_v3's latent projections) and the output layer.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrain.models.hf import to_hf_config

    cfg = _tiny_moe(arch)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**to_hf_config(cfg)),
        attn_implementation="eager",
        experts_implementation="eager",
    )
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(tokens)
    assert counter.get_total_flops() == pytest.approx(
        F.forward_flops_per_token(cfg) * tokens.numel(), rel=1e-12
    )
    experts = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    assert F.expert_parameters(cfg) == experts
    assert F.num_parameters(cfg) == sum(p.numel() for p in hf.parameters())


def test_context_parallel_bytes_by_hand() -> None:
    # A TP rank of tp=8 at cp=16 and 131,072 tokens: 8192 tokens, 16 query heads, 1 kv head of 128.
    ring = C.cp_layer(16, "ring", 8192, 16, 1, 128, 2, "none")
    block = 2 * 8192 * 1 * 128 * 4  # K and V in fp32: 8 MiB
    assert block == 8 * MIB
    assert ring.fwd == (C.Comm("send", "cp", 2, block),) * 15
    assert ring.bwd == (C.Comm("send", "cp", 2, block),) * 31  # K/V 15 times, dK/dV 15 + 1 (home)
    assert len(C.cp_layer(16, "ring", 8192, 16, 1, 128, 2, "selective").bwd) == 15 + 31
    a2a = C.cp_layer(16, "all_to_all", 8192, 16, 1, 128, 2, "none")
    q = C.Comm("all_to_all", "cp", 16, 8192 * 16 * 128 * 2)  # 32 MiB
    kv = C.Comm("all_to_all", "cp", 16, 8192 * 16 * 128 * 2)  # the kv head repeated 16 times
    assert a2a.fwd == a2a.bwd == (q, kv, kv, q)
    assert C.cp_kv_heads(8, 16) == 16 and C.cp_kv_heads(8, 4) == 8 and C.cp_kv_heads(6, 4) == 12
    assert C.cp_layer(1, "ring", 8192, 16, 1, 128, 2, "none") == C.PassComms()


def _cost(
    config: str, gpus: int, cluster: str = "h100-80gb", overrides: list[str] | None = None
) -> CostModel:
    job = load(config, overrides or [])
    return CostModel(Workload.from_job(job), load_cluster(cluster).view(gpus))


def test_ring_transfers_hide_behind_the_blocks_computed_meanwhile() -> None:
    cost = _cost("configs/llama3-405b.yaml", 16384, overrides=LONG)
    cp, tok = 4, 131072 // 4
    block = 2 * tok * 4 * 128 * 4  # fp32 K and V of the 4 kv heads of a rank of tp=2
    t = block / cost.c.intra.bytes_per_s + cost.c.intra.alpha  # tp=2 x cp=4 ranks share a node
    # Nothing to overlap with: every block waits (cp-1 forward; 2cp-1 backward).
    fwd, bwd = cost._cp_exposed(2, tok, cp, "ring", "none", 0.0, 0.0)
    assert fwd == pytest.approx(3 * t) and bwd == pytest.approx(7 * t)
    # Blocks slower than the transfers: only the backward's last send of dK/dV home is left.
    fwd, bwd = cost._cp_exposed(2, tok, cp, "ring", "none", 100.0, 100.0)
    assert fwd == 0.0 and bwd == pytest.approx(t)
    # Selective recomputation runs the forward's ring again in the backward.
    assert cost._cp_exposed(2, tok, cp, "ring", "selective", 0.0, 0.0)[1] == pytest.approx(10 * t)


def test_expert_all_to_all_time_by_hand() -> None:
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    tok, h, k = 4096, 4096, 2
    volume = 2 * tok * k * h  # bf16 routed rows of the rank
    intra, inter = cost.c.intra, cost.c.inter
    # ep=8 in one node of 8; per MoE layer (all 32 are) a dispatch and a combine.
    one = 7 / 8 * volume / intra.bytes_per_s + 7 * intra.alpha
    assert cost._ep_time(1, tok, 1, 8, 64) == pytest.approx(2 * one)
    # ep=16 spans two nodes: 8 members per node drive 8 NICs.
    one = 15 / 16 * volume / min(8 * inter.bytes_per_s, intra.bytes_per_s) + 15 * inter.alpha
    assert cost._ep_time(1, tok, 1, 16, 64) == pytest.approx(2 * one)
    assert cost._ep_time(1, tok, 1, 1, 64) == 0.0


def test_full_recomputation_replays_the_expert_all_to_alls() -> None:
    # The backward of a fully recomputed MoE layer runs its forward's dispatch and combine again before the
    # reverse exchanges (collectives.ep_layer lists them; the traced-collective test checks that list
    # against a real step): its time is two passes' worth, as the TP and CP collectives' are.
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    one = cost._ep_time(1, 4096, 1, 8, 64)
    for mode, backward in (("none", one), ("selective", one), ("full", 2 * one)):
        layer = cost._layer_costs(1, 1, False, mode, ep=8, dp=64)
        assert (layer.ep_fwd, layer.ep_bwd) == pytest.approx((one, backward)), mode
        exchanges = C.ep_layer(8, 8, 1, 1, mode)
        assert sum(c.op == "all_to_all" and c.nbytes == 1 for c in exchanges.bwd) == 2 * backward / one


def test_expert_state_divides_by_ep_and_shards_over_expert_data_parallel() -> None:
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    m = cost.w.model
    experts, total = F.expert_parameters(m), F.num_parameters(m)
    assert experts == 32 * 8 * 3 * 4096 * 14336  # 45.1B of Mixtral's 46.7B
    dense = total - experts

    def state(ep: int, zero: int) -> dict[str, float]:
        return cost.memory(Layout(dp=64, ep=ep, zero_stage=zero), inflight=1, num_micro=8)

    one, eight = state(1, 0), state(8, 0)
    assert one["params"] - eight["params"] == pytest.approx(2 * experts * 7 / 8)
    assert one["grads"] - eight["grads"] == pytest.approx(4 * experts * 7 / 8)
    # ZeRO-1: dense state over dp=64, each expert's over the 8 ranks holding it (dp / ep).
    assert state(8, 1)["optimizer"] == pytest.approx(12 * (dense / 64 + experts / 8 / 8))


def test_context_parallelism_divides_activations() -> None:
    cost = _cost("configs/llama3-405b.yaml", 16384, overrides=LONG)
    base = Layout(tp=8, pp=16, dp=8, sequence_parallel=True, recompute="full", zero_stage=1)

    def activations(**kw: object) -> float:
        return cost.memory(replace(base, **kw), inflight=16, num_micro=16)["activations"]

    assert activations(cp=16, dp=8, cp_comm="all_to_all") == pytest.approx(activations(cp=1, dp=128) / 16)


@pytest.mark.slow  # multi-second (5 s on two idle cores): runs in CI, not in -m 'not slow'
def test_405b_at_131k_tokens_on_16384_h100s_plans_context_parallelism(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # The planner's layout against Llama 3's (tp=8, cp=16, pp=16, dp=8), both predicted.
    argv = ["--config", "configs/llama3-405b.yaml", "--cluster", "h100-80gb", "--gpus", "16384", *LONG]
    written = tmp_path / "best.yaml"
    assert plan_tool.main([*argv, "--top", "3", "--write", str(written)]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    row = dict(zip(lines[first - 1].split(), lines[first].split(), strict=False))
    out = "\n".join(lines)
    cp = int(row["cp"].rstrip("ra"))
    assert cp > 1 and float(row["step_s"]) > 0
    assert "Why cp=" in out
    best = load(str(written)).parallel
    assert (best.cp, best.cp_comm[0]) == (
        cp,
        row["cp"][-1],
    ) and best.tp * best.cp * best.pp * best.dp == 16384
    job = load("configs/llama3-405b.yaml", LONG)
    fixed = parse_fixed("parallel.tp=8 parallel.cp=16 parallel.pp=16 parallel.cp_comm=all_to_all")
    llama3 = plan_job(job, load_cluster("h100-80gb"), 16384, fixed=fixed, top=1).best
    assert llama3.fits and (llama3.layout.cp, llama3.layout.dp) == (16, 8)


@pytest.mark.slow  # multi-second (3.5 s a case on two idle cores): runs in CI, not in -m 'not slow'
@pytest.mark.parametrize("config,cluster", [("mixtral-8x7b", "h200-141gb"), ("qwen3-30b-a3b", "h100-80gb")])
def test_moe_plans_expert_parallelism_and_say_why(config: str, cluster: str, capsys) -> None:
    argv = ["--config", f"configs/{config}.yaml", "--cluster", cluster, "--gpus", "64", "--top", "1"]
    assert plan_tool.main(argv) == 0
    out = capsys.readouterr().out
    # Either ep=1 cannot fit at all, or the line compares against the best layout that has ep=1.
    assert "Why ep=" in out and ("no layout with ep=1 fits" in out or "for the best layout with ep=1" in out)
    assert "; placed inside the" in out or "; placed over the" in out  # where the EP group lies
    result = plan_job(load(f"configs/{config}.yaml"), load_cluster(cluster), 64, top=1)
    assert result.best.fits and result.best.layout.ep > 1 and result.best.ep_comm > 0


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_evaluate_fixes_cp_and_ep_and_the_trainers_rules_prune() -> None:
    assert parse_fixed("parallel.cp=16 parallel.ep=8 parallel.cp_comm=ring") == dict(
        cp=16, ep=8, cp_comm="ring"
    )
    job = load("configs/mixtral-8x7b.yaml")
    cluster = load_cluster("h200-141gb")
    assert plan_job(job, cluster, 64, fixed=parse_fixed("parallel.ep=4"), top=1).best.layout.ep == 4
    long = replace(job, model=replace(job.model, seq_length=8192))
    assert plan_job(long, cluster, 64, fixed=dict(cp=2), top=1).best.layout.cp == 2  # MoE runs under cp
    both = plan_job(long, cluster, 64, fixed=dict(cp=2, ep=2), top=1).best.layout  # EP composes with CP
    assert (both.cp, both.ep) == (2, 2) and both.dp % 2 == 0
    with pytest.raises(ConfigError, match="has no experts"):
        plan_job(load("configs/llama3-8b.yaml"), cluster, 64, fixed=dict(ep=2))


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_auto_writes_cp_and_ep() -> None:
    job = load("configs/llama3-405b.yaml", [*LONG, "parallel.auto=true"])
    overrides, explanation = plan_for_world(job, 16384, "h100-80gb")
    assert overrides["parallel.cp"] > 1 and "cp=" in explanation
    with_overrides(job, overrides)  # what the trainer does with them: validates, cp with parallel.auto
    moe = load("configs/mixtral-small.yaml", ["parallel.auto=true"])
    overrides, _ = plan_for_world(moe, 8, "h100-80gb")
    assert "parallel.ep" in overrides
    with_overrides(moe, overrides)
    layout = Layout(dp=64, ep=8, zero_stage=1)
    assert layout_overrides(layout)["parallel.ep"] == 8
    assert with_layout(moe, layout).parallel.ep == 8
    assert Software().moe_imbalance == 1.0


@pytest.mark.parametrize(
    "model,batch,cluster",
    [
        # 4 sequences of 32K tokens on 16 GPUs: dp <= 4, the rest splits the sequence.
        (ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=4,
                     vocab_size=32000, seq_length=32768), 4, "a100-80gb"),
        # 16 experts of 16 layers, 8.9B parameters, on 40 GB devices.
        (ModelConfig(arch="mixtral", num_layers=16, hidden_size=2048, num_attention_heads=16, num_kv_heads=4,
                     ffn_hidden_size=5632, num_experts=16, num_experts_per_tok=2, vocab_size=32000,
                     seq_length=1024), 64, "a100-40gb"),
    ],
    ids=["long-sequence", "moe"],
)  # fmt: skip
@pytest.mark.slow  # multi-second (15 s on two idle cores): runs in CI, not in -m 'not slow'
def test_coordinate_descent_finds_the_exhaustive_optimum_over_cp_and_ep(model, batch, cluster) -> None:
    work = Workload(model, batch, "bf16")
    view = load_cluster(cluster).view(16)
    exhaustive = plan(work, view, 16, method="exhaustive", simulate_top=False)
    descent = plan(work, view, 16, method="coordinate", simulate_top=False)
    best = exhaustive.best
    assert best.fits and (best.layout.cp > 1 or best.layout.ep > 1)
    assert descent.best.step_time == pytest.approx(best.step_time, rel=1e-12)
    assert descent.evaluated < exhaustive.evaluated


def test_expert_groups_lie_where_the_topology_carves_them() -> None:
    # Expert domain index dp + dp * (cp + cp * tp) (llmtrain.parallel.topology); global rank tp + tp * (cp +
    # cp * dp). EP inside dp at tp=2: DP ranks 0 and 2 hold different experts, the TP pair the same ones.
    assert C.expert_groups(2, 1, 2, 2) == ((0, 2), (0, 1))
    # Spanning TP (dp=1): the TP pair is the EP group, nobody else holds the same experts.
    assert C.expert_groups(2, 1, 1, 2) == ((0, 1), (0,))
    # Spanning CP: all 2 DP ranks and both CP ranks (tp=2: global ranks 0, 2, 4, 6); edp: the TP pair.
    assert C.expert_groups(2, 2, 2, 4) == ((0, 2, 4, 6), (0, 1))
    # 8 devices a node, tp=8, dp=8, ep=8 inside dp: one member per node (stride 8); the expert-DP group is a
    # node's TP ranks. ep=16 spanning 2 of the 8 TP ranks: two members per node, 8 nodes apart.
    assert C.expert_group_strides(8, 1, 8, 8, 8) == (8, 1)
    assert C.expert_group_strides(8, 1, 8, 16, 8) == (4, 1)
    assert C.expert_group_strides(1, 1, 64, 8, 8) == (1, 8)
    assert C.ep_placement(1, 1, 64, 8) == "inside the 64 data-parallel ranks"
    spanning_cp = "over the 4 data-parallel ranks and 2 of the 2 context-parallel ranks"
    assert C.ep_placement(1, 2, 4, 8) == spanning_cp
    assert C.ep_placement(4, 1, 2, 4) == "over the 2 data x context-parallel ranks and 2 of the 4 TP ranks"


def test_the_planner_accepts_the_ep_placements_the_trainer_accepts() -> None:
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    for tp, cp, dp, ep in ((1, 1, 64, 8), (8, 1, 8, 2), (8, 1, 1, 8), (1, 2, 4, 8), (2, 2, 2, 8)):
        layout = Layout(tp=tp, cp=cp, dp=dp, pp=64 // (tp * cp * dp), ep=ep)
        assert cost._expert_problem(layout) == "", layout
    refused = cost._expert_problem(Layout(tp=2, dp=2, pp=16, ep=8))  # dp x cp x 4, but 4 does not divide tp
    assert "parallel.ep=8 cannot be carved out of the tp x cp x dp = 2x1x2 ranks" in refused


def test_router_statistics_and_moe_tp_collectives_are_timed() -> None:
    # Every Mixtral layer is MoE: under TP its forward runs the attention region's all-reduce, the output
    # all-gather of the routed slices, and the router statistics' all-reduce (3E + 2 fp32) over the pair.
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    m, tp, e = cost.w.model, 2, cost.act_bytes
    activation = e * m.seq_length * m.hidden_size
    layer = cost._layer(tp, 1, False, "none")
    stats = cost.c.all_reduce(4 * (3 * m.num_experts + 2), tp)
    moe_tp = cost.c.all_reduce(activation, tp) + cost.c.all_gather(activation, tp)
    assert layer.tp_fwd == pytest.approx(moe_tp + stats)
    assert layer.tp_bwd == pytest.approx(moe_tp)
    # Under CP the CP ranks' sum follows, on ranks tp apart.
    ring = cost._layer(tp, 1, False, "none", 2)
    exposed = cost._cp_exposed(tp, m.seq_length // 2, 2, "ring", "none", *cost._ring_core(tp, 1, 2))
    assert ring.cp_fwd == pytest.approx(exposed[0] + cost.c.all_reduce(4 * (3 * m.num_experts + 2), 2, tp))


def _gemm_shapes(cost: CostModel, tp: int) -> list[tuple[float, float, float]]:
    """The (m, n, k) of every matmul the cost model times for a layer of one sequence at `tp`."""
    shapes: list[tuple[float, float, float]] = []
    device = cost.dev

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(device, name)

        def gemm_time(self, m: float, n: float, k: float, *args: object, **kw: object) -> float:
            shapes.append((m, n, k))
            return device.gemm_time(m, n, k, *args, **kw)

    cost.dev = Recording()
    try:
        cost._layer(tp, 1, False, "none")
    finally:
        cost.dev = device
    return shapes


def test_moe_matmuls_under_tp_run_whole_weights_on_the_ranks_tokens() -> None:
    # Mixtral at tp=2: each rank routes 2048 of the 4096 tokens through the whole router and experts (14336
    # wide), 4096 top-2 rows over 8 experts, 512 a expert.
    cost = _cost("configs/mixtral-8x7b.yaml", 64)
    shapes = _gemm_shapes(cost, 2)
    assert (2048, 8, 4096) in shapes  # the router
    assert (512, 2 * 14336, 4096) in shapes and (512, 4096, 14336) in shapes  # an expert's gate-up, down


def test_latent_attention_keeps_its_down_projections_whole_under_tp() -> None:
    cfg = _tiny_moe("deepseek_v3")
    h, rank, kv, rope = 64, 32, 16, 8
    whole = h * rank + rank + h * (kv + rope) + kv  # q_a_proj, q_a_norm, kv_a_proj, kv_a_norm
    assert F.attention_whole_parameters(cfg) == whole
    attention = F.latent_attention_parameters(cfg)
    one, two = (C.rank_parameters(cfg, tp, 1, False, False)[0] for tp in (1, 2))
    dense_mlp = 3 * h * cfg.ffn_size
    # Split by heads: the up-projections and o_proj, and the dense MLP; whole: the down-projections, norms.
    assert one - two == (attention - whole) // 2 + dense_mlp // 2
    # The rank's matmuls: the down-projections whole (h -> rank + kv + rope) on every token of the rank, the
    # up-projections (as many multiply-adds as their weights) over its half of the heads.
    cost = CostModel(Workload(cfg, 8, "bf16"), load_cluster("h100-80gb").view(2))
    shapes = _gemm_shapes(cost, 2)
    up = F.latent_projection_params(cfg) - F.latent_down_projection_params(cfg)
    assert (16, up / (2 * h), h) in shapes and (16, rank + kv + rope, h) in shapes
    assert (16, F.latent_projection_params(cfg) / (2 * h), h) not in shapes  # not all split by heads


def test_search_places_ep_across_context_parallel_ranks_where_dp_cannot_hold_it() -> None:
    # DeepSeek-V3 on 256 H100s with pp=32, cp=2 fixed leaves dp=4: with the gradients accumulated unsharded
    # (grad_reduce=step) no ep inside dp fits (fewer experts' state per rank needs ep >= 8); ep=8 over the
    # 4 DP ranks and both CP ranks does, and the note says so.
    job = load("configs/deepseek-v3.yaml")
    fixed = dict(pp=32, cp=2, tp=1, grad_reduce="step")
    result = plan_job(job, load_cluster("h100-80gb"), 256, fixed=fixed, top=3)
    best = result.best
    assert best.fits and best.layout.dp == 4 and best.layout.ep == 8, best.layout.short()
    inside = [e for e in result.ranked if e.layout.dp % e.layout.ep == 0]
    assert inside and not any(e.fits for e in inside)
    note = next(n for n in parallelism_notes(result) if n.startswith("ep="))
    assert "placed over the 4 data-parallel ranks and 2 of the 2 context-parallel ranks" in note
    assert "with ep=8 inside dp" in note
