"""The published recipe tables (llmtrain/planner/data/*.csv) and their validation (validation/recipes.py).

Fast: the tables load and name their source, every row is either expressible or skipped with a reason, the
score leaves out the rows of a table a constant was set from, and bad input is named. Slow: every expressible
row evaluates.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.config.loader import load
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cost.flops import num_parameters
from llmtrain.planner.validation.recipes import (
    TABLES,
    Recipe,
    express,
    load_recipes,
    scored,
    summarise,
    table_path,
    tuned_tables,
    validate_recipes,
)

A100_DENSE_PEAK_TFLOPS = 312.0


def all_rows():
    return [(table, row) for table in TABLES for row in load_recipes(table)]


def test_every_table_names_its_source_and_flops_convention():
    for table in TABLES:
        header = "\n".join(
            line for line in table_path(table).read_text().splitlines() if line.startswith("#")
        )
        assert "Source:" in header and "FLOPs convention" in header, table
        assert load_recipes(table), table


def test_the_kept_aside_tables_are_not_among_them():
    # Megatron-Bridge's Qwen3 rows and NeMo 24.07's summary are kept aside to judge the planner.
    for table, row in all_rows():
        assert not (table == "megatron_bridge_h100" and row["model"].startswith("qwen3")), row
        assert row["release"] != "24.07", row


def test_every_row_is_expressible_or_skipped_with_a_reason():
    recipes = [express(table, row) for table, row in all_rows()]
    expressible = [r for r in recipes if not r.skipped]
    # Rows on shipped hardware of models in configs/: NeMo AutoModel's, torchtitan A100's and H100's (the
    # h100-96gb-500w preset) and Megatron-Bridge's (all FP8 but for GPT-OSS, not in configs/).
    assert {r.table for r in expressible} == {
        "nemo_automodel_h100",
        "torchtitan_a100",
        "torchtitan_h100",
        "megatron_bridge_h100",
    }
    assert {r.row["precision"] for r in expressible if r.table == "megatron_bridge_h100"} == {"fp8"}
    for r in recipes:
        assert r.kind in ("dense", "moe", "long")
        assert "not modelled" not in r.skipped, r.row
        if r.row["model"] in ("gpt-oss-120b", "kimi-k2", "llama2-7b"):
            assert f"model {r.row['model']} is not in the zoo" in r.skipped
        assert "no cluster file describes" not in r.skipped, r.row
    assert all(r.kind == "moe" for r in recipes if r.row["model"].startswith(("gpt-oss", "deepseek", "kimi")))
    # torchtitan's "selective" checkpointing is its op-level policy (its llama3_8b.toml), which the cost
    # model prices (selective_op): those rows are expressible.
    titan = [r for r in recipes if r.table.startswith("torchtitan") and r.row["recompute"] == "selective_op"]
    assert len(titan) == 7 and not any(r.skipped for r in titan)


def test_step_times_come_from_the_page_or_from_tokens_per_second():
    recipes = {
        (r.table, r.row["release"], r.row["model"], r.row["gpus"]): r
        for r in map(express, *zip(*all_rows(), strict=True))
    }
    # NeMo AutoModel states the step: 37.87 s; it agrees with its tokens/s/GPU: 8192 * 4096 / 865 / 1024.
    dsv3 = recipes[("nemo_automodel_h100", "2025-10-02", "deepseek-v3", "1024")]
    assert dsv3.measured == 37.87 and abs(8192 * 4096 / 865 / 1024 / 37.87 - 1) < 0.01
    # torchtitan: 64 sequences of 8192 tokens at 331 tokens/s on each of 64 GPUs.
    llama70 = recipes[("torchtitan_a100", "041336434916", "llama3-70b", "64")]
    assert llama70.measured == pytest.approx(64 * 8192 / (331 * 64))
    # NeMo's long-sequence table gives no batch: no step time.
    assert all(r.measured is None for (t, *_), r in recipes.items() if t == "nemo_long_sequence_h100")


def test_torchtitan_a100_sequence_length_agrees_with_its_mfu_column():
    # torchtitan's MFU: (6 * parameters + 12 * layers * hidden * seq) FLOPs per token over 312 TFLOP/s; the
    # page prints it to 0.1%, so at 8192 tokens (the length the table assumes) it agrees within 0.1 point.
    for row in load_recipes("torchtitan_a100"):
        model = load(row["model"]).model
        seq = int(row["seq_length"])
        per_token = 6 * num_parameters(model) + 12 * model.num_layers * model.hidden_size * seq
        mfu = float(row["tokens_per_gpu_s"]) * per_token / (A100_DENSE_PEAK_TFLOPS * 1e12)
        assert abs(100 * mfu - float(row["mfu_pct"])) <= 0.1, row


def fake(table, error, tuned=False, kind="dense"):
    """A recipe whose prediction is `error` off a 10 s measurement (the score reads only step times)."""
    recipe = Recipe(table, {}, kind, 10.0, tuned=tuned)
    recipe.published = SimpleNamespace(step_time=10.0 * (1 + error), optimizer=0.0)
    return recipe


def test_the_score_leaves_out_tuned_and_skipped_rows():
    recipes = [
        fake("a", 0.02),
        fake("a", -0.04),
        fake("b", 0.5, tuned=True),
        Recipe("c", {}, "moe", None, "fp8"),
    ]
    assert scored(recipes) == recipes[:2]
    s = summarise(recipes)
    assert set(s) == {"a", "dense", "all"}
    assert s["all"]["rows"] == 2 and s["all"]["median_abs_error"] == pytest.approx(0.03)
    assert s["all"]["max_abs_error"] == pytest.approx(0.04)


def test_a_constant_citing_a_table_marks_it_tuned(tmp_path):
    preset = Path(str(table_path(TABLES[0]))).parents[1] / "clusters" / "h100-80gb.yaml"
    text = preset.read_text().replace(
        'memory_bandwidth_gbs: "vendor specification: H100 datasheet, SXM 3.35 TB/s"',
        'memory_bandwidth_gbs: "fitted to the rows of nemo_automodel_h100"',
    )
    cluster = tmp_path / "fitted.yaml"
    cluster.write_text(text)
    assert tuned_tables([str(cluster)]) == {
        "nemo_automodel_h100": [f"{cluster}:devices.h100-sxm5-80gb.memory_bandwidth_gbs"]
    }
    assert tuned_tables(["h100-80gb", "a100-80gb", "h100-96gb-500w"]) == {}


def test_torchtitans_h100_preset_sources_every_constant_and_no_table():
    # h100-96gb-500w (torchtitan's Grand Teton H100s): each constant names its source; the power cap's rate is
    # an assumption bounded by the vendor's SXM and NVL peaks, not a number set from torchtitan's rows.
    import yaml

    raw = yaml.safe_load(
        (Path(str(table_path(TABLES[0]))).parents[1] / "clusters" / "h100-96gb-500w.yaml").read_text()
    )
    (name, device), *_ = raw["devices"].items()
    constants = {f"devices.{name}.{k}" for k in device} | {
        f"links.{link}.{k}" for link, fields in raw["links"].items() for k in fields
    }
    assert constants == set(raw["sources"])
    peak = load_cluster("h100-96gb-500w").view(8).device.peak_tflops["bf16"]
    assert 835.5 < peak < 989.4  # between the NVL's and the SXM's dense BF16 peaks, as torchtitan's page says
    assert all(t not in src for src in raw["sources"].values() for t in TABLES)


def test_a_cluster_missing_a_constant_is_named(tmp_path):
    preset = Path(str(table_path(TABLES[0]))).parents[1] / "clusters" / "h100-80gb.yaml"
    cluster = tmp_path / "no-bf16.yaml"
    cluster.write_text(preset.read_text().replace("bf16: 989.4, ", ""))
    load_cluster(str(cluster))  # a valid cluster file: it just cannot price bf16
    row = dict(load_recipes("torchtitan_a100")[2], cluster=str(cluster))
    assert express("torchtitan_a100", row).skipped == (
        "cluster dgx-h100-80gb lacks devices.h100-sxm5-80gb.peak_tflops.bf16"
    )


def test_bad_tables_are_named(tmp_path):
    with pytest.raises(
        ConfigError, match="recipe table nope.csv does not exist; pass a CSV with the columns"
    ):
        load_recipes("nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("# a comment\nmodel,gpus\nllama3-8b,8\n")
    with pytest.raises(ConfigError, match="lacks the column\\(s\\) release, cluster, precision"):
        load_recipes(str(bad))


@pytest.fixture(scope="module")
def bf16_and_torchtitan():
    """The published layouts of the AutoModel and torchtitan tables, evaluated once for the tests below."""
    return validate_recipes(("nemo_automodel_h100", "torchtitan_a100", "torchtitan_h100"), search_best=False)


@pytest.mark.slow
def test_every_expressible_row_evaluates(bf16_and_torchtitan):
    recipes = bf16_and_torchtitan
    for r in recipes:
        assert (r.published is None) == bool(r.skipped), (r.row, r.skipped)
    assert len(scored(recipes)) == 18
    bf16 = [r for r in recipes if r.table != "torchtitan_h100"]
    assert summarise(bf16)["dense"]["max_abs_error"] <= 0.12


@pytest.mark.slow
def test_torchtitan_h100_long_context_rows_are_scored_on_their_preset(bf16_and_torchtitan):
    # torchtitan's Table 2 (FP8, FSDP + CP, 32K to 128K tokens) on h100-96gb-500w, whose constants cite the
    # page's hardware description and the vendor's bounds, not these rows: issue 38's long-context target
    # (median <= 10%). FSDP 1 x CP 8 shards over CP, which llmtrain's ZeRO does not: named, not scored.
    titan = [r for r in bf16_and_torchtitan if r.table == "torchtitan_h100"]
    assert not any(r.tuned for r in titan)
    assert [r.row["release"] for r in scored(titan) if r.kind == "long"] == [
        "table2-fsdp8-cp1",
        "table2-fsdp4-cp2",
        "table2-fsdp2-cp4",
    ]
    (cp8,) = [r for r in titan if r.row["release"] == "table2-fsdp1-cp8"]
    assert (
        cp8.skipped.startswith("the planner rejects the published layout: ")
        and "ZeRO needs dp > 1" in cp8.skipped
    )


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue 38's long-context target is missed: with Table 2's float8 casts fused as torch.compile "
    "runs them (compiled_float8) the median is 10.3% (5.9%, 17.0%, 10.3%; 9.4% before), the rows' error "
    "being their ring attention's (docs/planner.md)",
)
def test_torchtitan_h100_long_context_rows_meet_the_target(bf16_and_torchtitan):
    # Issue 38's long-context target (median <= 10%) on torchtitan's Table 2, on a preset none of whose
    # constants is set from these rows.
    titan = [r for r in bf16_and_torchtitan if r.table == "torchtitan_h100"]
    assert summarise(titan)["long"]["median_abs_error"] <= 0.10


@pytest.mark.slow
def test_the_fp8_rows_are_scored_within_the_dense_targets():
    # Issue 38's targets for dense rows (median <= 4%, max <= 12%), on the 8 FP8 dense rows of
    # Megatron-Bridge (no constant set from that table). Its one MoE row, DeepSeek-V3, recomputes modules
    # (its recipe's mla_up_proj and mlp), which the planner does not model: named, not scored.
    recipes = validate_recipes(("megatron_bridge_h100",), search_best=False)
    fp8 = [r for r in scored(recipes) if r.row["precision"] == "fp8"]
    assert len(fp8) == 8 and {r.kind for r in fp8} == {"dense"}
    summary = summarise(recipes)
    assert summary["dense"]["median_abs_error"] <= 0.04 and summary["dense"]["max_abs_error"] <= 0.12
    (dsv3,) = [r for r in recipes if r.row["model"] == "deepseek-v3"]
    assert dsv3.skipped == "recompute 'mla_up_proj+mlp' is not a mode the planner models"


def test_the_software_terms_of_the_published_frameworks():
    from dataclasses import replace

    from llmtrain.planner import CostModel, Layout, Software, Workload

    h100 = load_cluster("h100-80gb")
    llama = Workload(load("llama3-8b", ["model.seq_length=32768"]).model, 8)
    ring = Layout(dp=4, cp=2, recompute="full", zero_stage=3)
    ours, fused = (CostModel(llama, h100.view(8), Software(fused_ring_attention=f)) for f in (False, True))
    # Flash-attention blocks instead of fp32 matmul blocks: faster, and no fp32 block scores saved.
    assert fused.evaluate(ring).compute < ours.evaluate(ring).compute
    kept = replace(ring, recompute="none")  # (full recomputation saves only each layer's input either way)
    assert fused.evaluate(kept).memory["activations"] < ours.evaluate(kept).memory["activations"]
    # The all-to-all path is fused either way: the flag changes nothing there.
    a2a = replace(ring, cp_comm="all_to_all")
    assert fused.evaluate(a2a).step_time == ours.evaluate(a2a).step_time

    moe = Workload(load("mixtral-8x7b", ["model.router_aux_loss_coef=0"]).model, 64)
    inside = Layout(dp=8, ep=8, recompute="full", zero_stage=3)  # one node: EP and DP on NVLink
    plain, permuted = (CostModel(moe, h100.view(8), Software(fused_moe_permute=f)) for f in (False, True))
    assert permuted.evaluate(inside).compute < plain.evaluate(inside).compute
    # Across nodes the DP traffic hidden behind compute shares the NICs with the EP all-to-alls.
    across = CostModel(moe, h100.view(64))
    spread = Layout(dp=64, ep=8, recompute="full", zero_stage=3)  # EP inside a node: NVLink, no sharing
    wide = replace(spread, ep=16)  # EP over 2 nodes, DP too
    assert across._ep_link_sharing(spread, 1.0, 1.0, 2.0) == 0.0
    assert across._ep_link_sharing(wide, 1.0, 1.0, 2.0) == pytest.approx(1.0)  # half the link: twice as long
    assert across._ep_link_sharing(wide, 1.0, 5.0, 2.0) == pytest.approx(9.0)  # share capped at 0.9


def test_the_transformer_engine_terms_under_fp8():
    from llmtrain.planner import CostModel, Layout, Software, Workload

    h100 = load_cluster("h100-80gb").view(64)
    model = load("llama3-70b", ["model.seq_length=8192", "model.max_position_embeddings=8192"]).model
    layout = Layout(tp=4, pp=8, dp=2, virtual_stages=5, schedule="interleaved_1f1b", sequence_parallel=True)

    def cost(precision: str, **flags: bool) -> CostModel:
        return CostModel(Workload(model, 128, precision), h100, Software(**flags))

    torchao, te = cost("fp8"), cost("fp8", te_fp8=True)
    # Fused cast-transposes, weights cast once a step: fewer cast bytes; float8 inputs saved: less memory.
    assert sum(te._float8_cast_bytes(4, 8192)) < sum(torchao._float8_cast_bytes(4, 8192)) / 2
    assert te.evaluate(layout).memory["activations"] < torchao.evaluate(layout).memory["activations"]
    # ... only under fp8: bf16 is the same with and without the flag.
    assert cost("bf16", te_fp8=True).evaluate(layout).step_time == cost("bf16").evaluate(layout).step_time
    # Overlapped TP collectives and the causal half of the scores: each shortens the step.
    assert cost("fp8", tp_comm_overlap=True).evaluate(layout).tp_comm < torchao.evaluate(layout).tp_comm
    assert cost("fp8", causal_skip=True).evaluate(layout).compute < torchao.evaluate(layout).compute


def test_torchtitans_tensor_parallelism_under_float8():
    from collections import Counter

    from llmtrain.planner import CostModel, Layout, Software, Workload
    from llmtrain.planner.cost.collectives import Comm, PassComms

    model = load("llama3-70b", ["model.seq_length=8192", "model.max_position_embeddings=8192"]).model
    h100, tp, sbh = load_cluster("h100-80gb").view(64), 8, 8192 * model.hidden_size  # one sequence
    act = 2 * sbh  # bf16 bytes of the b x s x h activation

    def cost(precision: str = "fp8", recipe: str = "tensorwise", **flags: bool) -> CostModel:
        return CostModel(Workload(model, 8, precision, fp8_recipe=recipe), h100, Software(**flags))

    def gather(nbytes: int) -> Comm:
        return Comm("all_gather", "tp", tp, nbytes)

    scatter = Comm("reduce_scatter", "tp", tp, act)
    # llmtrain (hand count, collectives.tp_layer): the backward re-gathers the 4 column-parallel linears'
    # inputs besides the 2 output-gradient gathers, all in bf16.
    ours = cost().tp_layer(tp, act, True, "none")
    assert Counter(ours.fwd) == {gather(act): 2, scatter: 2}
    assert Counter(ours.bwd) == {gather(act): 6, scatter: 2}
    # torchtitan: the gathered input kept for the backward, and every all-gather in float8 (the region
    # inputs cast before PrepareFloat8ModuleInput gathers them, the row-parallel outputs' gradients before
    # Float8RowwiseParallel's backward gathers them): half the bytes of each gather; the reduce-scatters bf16.
    titan = cost(tp_saves_gathered_input=True, float8_tp=True)
    layer = titan.tp_layer(tp, act, True, "none")
    assert Counter(layer.fwd) == Counter(layer.bwd) == {gather(act // 2): 2, scatter: 2}
    assert Counter(titan.tp_layer(tp, act, True, "full").bwd) == {gather(act // 2): 4, scatter: 4}
    # Only tensorwise float8 gathers in float8 (torchtitan's rowwise recipes gather in bf16), and bf16 never.
    for other in (cost("fp8", "rowwise", float8_tp=True), cost("bf16", float8_tp=True)):
        assert Counter(other.tp_layer(tp, act, True, "none").fwd) == {gather(act): 2, scatter: 2}
    # Without sequence parallelism there is nothing to gather: the all-reduces stay.
    reduced = (Comm("all_reduce", "tp", tp, act),) * 2
    assert titan.tp_layer(tp, act, False, "none") == PassComms(reduced, reduced)
    # Memory: the QKV and MLP inputs kept whole (2 x s x h a sequence), in float8, instead of their bf16
    # sequence shards (2 x 2 bytes x s x h / tp).
    grown = titan.activation_bytes_per_layer(tp, 1, True, "none") - cost().activation_bytes_per_layer(
        tp, 1, True, "none"
    )
    assert grown == pytest.approx(2 * sbh * (1 - 2 / tp))
    # The step: fewer, smaller collectives exposed (9 activations' worth a layer against 16).
    layout = Layout(tp=tp, dp=8, sequence_parallel=True, recompute="full", zero_stage=3)
    assert titan.evaluate(layout).tp_comm < 0.6 * cost().evaluate(layout).tp_comm


def test_async_tp_exposes_between_one_chunk_and_the_synchronous_time():
    from llmtrain.planner import CostModel, Software, Workload
    from llmtrain.planner.cost.layer_time import micro_pipelined
    from llmtrain.planner.validation.recipes import row_software

    # The mechanism: tp chunks, one exposed, the others hidden behind a chunk of the matmul each.
    assert micro_pipelined(8.0, 0.0, 8) == 8.0  # no matmul to hide behind: all of it
    assert micro_pipelined(8.0, 8.0, 8) == micro_pipelined(8.0, 100.0, 8) == 1.0  # one chunk of eight
    assert micro_pipelined(8.0, 4.0, 8) == pytest.approx(1.0 + 7 / 8 * 4.0)  # and what outlasts the matmul
    model = load("llama3-70b", ["model.seq_length=8192", "model.max_position_embeddings=8192"]).model
    h100 = load_cluster("h100-80gb").view(64)

    def layer(sp: bool, **flags: bool):
        cost = CostModel(Workload(model, 8, "fp8"), h100, Software(float8_tp=True, **flags))
        return cost._layer_costs(8, 4, sp, "full")

    sync, overlapped = layer(True), layer(True, async_tp=True)
    for a, s in ((overlapped.tp_fwd, sync.tp_fwd), (overlapped.tp_bwd, sync.tp_bwd)):
        assert s / 8 <= a < s
    assert (overlapped.fwd, overlapped.bwd) == (sync.fwd, sync.bwd)  # the matmuls themselves unchanged
    # Without sequence parallelism the all-reduces are not micro-pipelined: nothing changes.
    assert layer(False, async_tp=True) == layer(False)
    # A row turns it on through its software column; an unknown flag is named, not scored.
    row = {"software": "async_tp"}
    assert row_software("torchtitan_h100", row).async_tp
    assert not row_software("torchtitan_h100", {}).async_tp
    bad = dict(load_recipes("torchtitan_h100")[-1], software="async_tp+magic")
    skipped = express("torchtitan_h100", bad).skipped
    assert "software 'magic' is not a flag a row may set (async_tp, fused_kernels" in skipped


def test_a_row_turns_a_flag_off_torchtitans_eager_rows_run_unfused():
    from llmtrain.planner import CostModel, Software, Workload
    from llmtrain.planner.cost import host_ops as H
    from llmtrain.planner.validation.recipes import row_software

    # `-flag` turns a flag of the table's software off, `flag` on; an unknown one is named either way.
    assert not row_software("torchtitan_h100", {"software": "-fused_kernels"}).fused_kernels
    assert row_software("torchtitan_h100", {"software": "-fused_kernels+async_tp"}).async_tp
    bad = dict(load_recipes("torchtitan_h100")[0], software="-magic")
    assert "software 'magic' is not a flag" in express("torchtitan_h100", bad).skipped
    # torchtitan's rows without torch.compile in their name run its eager Llama (separate PyTorch norm,
    # rotary, SwiGLU and add operators); the compiled ones Inductor's fused kernels.
    for row in load_recipes("torchtitan_h100"):
        eager = row["release"] in ("table1-fsdp", "table3-fsdp")
        assert row_software("torchtitan_h100", row).fused_kernels is not eager, row["release"]
    # What unfused prices on a GPU preset (no measured memory table): the reference operators' bytes
    # (host_ops.reference_bytes: RMSNorm's square, mean and two multiplies, the rotary multiplies, negation,
    # concatenation and add, SiLU and the gating multiply, the residual adds) at the HBM bandwidth, in place
    # of the fused kernels' passes (each norm, add, rotary and SwiGLU one read and write).
    model = load("llama3-8b", ["model.seq_length=8192", "model.max_position_embeddings=8192"]).model
    h100 = load_cluster("h100-96gb-500w").view(8)

    def layer(fused: bool):
        cost = CostModel(Workload(model, 16), h100, Software(fused_kernels=fused))
        return cost._layer_costs(1, 2, False, "none")

    tok, h, e = 2 * 8192, model.hidden_size, 2
    rotary = 2 * e * tok * (model.num_attention_heads + model.kv_heads) * model.head_size
    fused_f = 2 * 2 * e * tok * h + 2 * 3 * e * tok * h + 6 * e * tok * model.ffn_size + rotary
    ref_f, ref_b = H.reference_bytes(model, tok, 1, False, e)
    assert ref_f > 1.4 * fused_f  # the norms: 7 element passes each, not 2
    rate = h100.device.memory_bandwidth_gbs * 1e9 * h100.device.memory_efficiency
    eager, fused = layer(False), layer(True)
    assert eager.fwd - fused.fwd == pytest.approx((ref_f - fused_f) / rate)
    assert eager.bwd - fused.bwd == pytest.approx((ref_b - 2 * fused_f) / rate)


def test_torchtitans_op_level_selective_recompute():
    from llmtrain.planner import CostModel, Software, Workload

    model = load("llama3-8b", ["model.seq_length=8192", "model.max_position_embeddings=8192"]).model
    h100 = load_cluster("h100-80gb").view(8)

    def cost(precision: str) -> CostModel:
        return CostModel(Workload(model, 16, precision), h100, Software())

    bf16, fp8 = cost("bf16"), cost("fp8")
    h, f, kv = model.hidden_size, model.ffn_size, model.kv_heads * model.head_size
    # Its policy saves aten.mm's outputs but every second one of the block (wq, wk, wv, wo, w1, w3, w2):
    # wk, wo and w3 are recomputed; float8 linears multiply through torch._scaled_mm, not in its save list.
    assert [(n, saved) for n, _, _, saved in bf16.op_sac_linears(1)] == [
        (h, True), (kv, False), (kv, True), (h, False), (f, True), (f, False), (h, True),
    ]  # fmt: skip
    assert not any(saved for *_, saved in fp8.op_sac_linears(1))
    # Time: more recomputed than selective (the attention core), less than full (the whole forward); under
    # float8 every linear again, so more than under bf16.
    for c in (bf16, fp8):
        redo = {m: c._layer_costs(1, 2, False, m).bwd for m in ("none", "selective", "selective_op", "full")}
        assert redo["none"] < redo["selective_op"] < redo["full"]
    share = [
        (c._layer_costs(1, 2, False, "selective_op").bwd - c._layer_costs(1, 2, False, "none").bwd)
        / (c._layer_costs(1, 2, False, "full").bwd - c._layer_costs(1, 2, False, "none").bwd)
        for c in (bf16, fp8)
    ]
    assert share[0] < share[1] < 1
    # Memory (hand count, 2 sequences): the layer's input, the saved linears' outputs (q, v, w1, w2) and
    # attention's output with its fp32 log-sum-exp, between full recompute's input alone and no recompute.
    tok, a = 2 * 8192, model.num_attention_heads
    saved = 2 * tok * (h + (h + kv + f + h) + h) + 4 * tok * a
    assert bf16.activation_bytes_per_layer(1, 2, False, "selective_op") == pytest.approx(saved)
    full, none = (bf16.activation_bytes_per_layer(1, 2, False, m) for m in ("full", "none"))
    assert full < saved < none
    # Dense models only: a MoE layer's experts are grouped GEMMs, which the policy's count does not see.
    moe = CostModel(Workload(load("mixtral-8x7b").model, 8), h100)
    with pytest.raises(ValueError, match="selective_op"):
        moe.op_sac_linears(1)


def test_a_layout_the_planner_rejects_is_named_not_scored():
    from llmtrain.planner.validation.recipes import evaluate

    row = dict(load_recipes("torchtitan_a100")[2], micro_batch="3")  # 64 sequences on 64 ranks: 1 each
    recipe = evaluate(express("torchtitan_a100", row), search_best=False)
    assert recipe.published is None and scored([recipe]) == []
    assert recipe.skipped == (
        "the planner rejects the published layout: "
        "train.micro_batch_size=3 does not divide global_batch/dp = 1"
    )


def test_each_row_is_reported_as_it_is_done():
    # validate_planner prints a progress line per row from on_row: called once per row, in order, after the
    # row is evaluated (its prediction set) or skipped (its reason set).
    seen = []
    recipes = validate_recipes(
        ("torchtitan_a100",),
        search_best=False,
        on_row=lambda i, n, r: seen.append((i, n, r, r.published is not None or bool(r.skipped))),
    )
    assert [(i, n) for i, n, _, _ in seen] == [(i, len(recipes)) for i in range(1, len(recipes) + 1)]
    assert [r for _, _, r, _ in seen] == recipes and all(done for *_, done in seen)
