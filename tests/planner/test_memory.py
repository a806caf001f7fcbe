"""Memory per rank against hand-computed cases: bytes per parameter, Korthikanti et al. 2022 activations."""

import pytest

from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cost.layout import Layout, Software, Workload
from llmtrain.planner.cost.model import CostModel

GPT = ModelConfig(
    arch="gpt",
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    vocab_size=51200,
    seq_length=2048,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


def model(precision="bf16", software=None, gpus=8, batch=64):
    return CostModel(Workload(GPT, batch, precision), load_cluster("a100-80gb").view(gpus), software)


def state_bytes(mem):
    return mem["params"] + mem["grads"] + mem["optimizer"]


def test_eighteen_bytes_per_parameter_bf16_with_fp32_grads():
    cm = model()
    layout = Layout(tp=1, pp=1, dp=8, micro_batch=1)
    params = max(cm._params_on_rank(layout))
    assert params == pytest.approx(cm.params.total)
    assert state_bytes(cm.memory(layout, 1, 8)) == pytest.approx(18 * params)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_distributed_optimizer_is_six_plus_twelve_over_d(dp):
    cm = model(gpus=dp)
    layout = Layout(tp=1, pp=1, dp=dp, micro_batch=1, zero_stage=1)
    params = cm.params.total
    assert state_bytes(cm.memory(layout, 1, 8)) == pytest.approx((6 + 12 / dp) * params)


def test_fp32_training_is_sixteen_bytes():
    cm = model("fp32")
    assert state_bytes(cm.memory(Layout(tp=1, pp=1, dp=8, micro_batch=1), 1, 8)) == pytest.approx(
        16 * cm.params.total
    )


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_korthikanti_activation_formulas(tp):
    # Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit activations, dropout on).
    cm = model(software=Software(flash_attention=False))
    s, b, h, a = 2048, 2, 1024, 16
    sbh = s * b * h
    per = cm.activation_bytes_per_layer
    assert per(tp, b, False, "none") == pytest.approx(sbh * (10 + 24 / tp + 5 * a * s / (h * tp)))
    if tp > 1:
        assert per(tp, b, True, "none") == pytest.approx(sbh * (34 / tp + 5 * a * s / (h * tp)))
        assert per(tp, b, True, "selective") == pytest.approx(sbh * 34 / tp)
    assert per(tp, b, False, "selective") == pytest.approx(sbh * (10 + 24 / tp))
    assert per(tp, b, False, "full") == pytest.approx(2 * sbh)


def test_flash_attention_drops_the_score_matrix():
    s, b, h = 2048, 1, 1024
    flash = model().activation_bytes_per_layer(1, b, False, "none")
    assert flash == pytest.approx(34 * s * b * h)


def test_activations_scale_with_inflight_microbatches_and_oversize_layouts_are_marked():
    small_vocab = ModelConfig(
        arch="gpt", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=1024, seq_length=2048
    )
    cm = CostModel(Workload(small_vocab, 64, "bf16"), load_cluster("a100-80gb").view(8))
    fits = cm.evaluate(Layout(tp=1, pp=8, dp=1, micro_batch=1, schedule="1f1b", recompute="full"))
    gpipe = cm.evaluate(Layout(tp=1, pp=8, dp=1, micro_batch=1, schedule="gpipe", recompute="full"))
    # gpipe keeps all 64 micro-batches, 1f1b pp=8 of them on the first rank.
    ratio = (gpipe.memory["activations"]) / (fits.memory["activations"])
    assert ratio == pytest.approx(64 / 8, rel=0.01)
    big = CostModel(
        Workload(
            ModelConfig(
                arch="gpt",
                num_layers=96,
                hidden_size=12288,
                num_attention_heads=96,
                vocab_size=51200,
                seq_length=2048,
            ),
            64,
            "bf16",
        ),
        load_cluster("a100-80gb").view(8),
    )
    est = big.evaluate(Layout(tp=8, pp=1, dp=1, micro_batch=1, recompute="full"))
    assert not est.fits and "GiB" in est.why and "optimizer" in est.why


@pytest.mark.parametrize("zero, tp", [(1, 1), (3, 1), (1, 2)])
def test_muon_keeps_one_momentum_buffer_on_the_blocks_and_assembles_them_whole(zero, tp):
    """train.optimizer=muon: 4 bytes fewer per block parameter (sharded like AdamW's moments), embeddings and
    head on AdamW's 8, plus the stage's whole fp32 matrices in buffers; its step adds the all-reduce of
    those matrices and Newton-Schulz time."""
    adamw, muon = (
        model(gpus=8),
        CostModel(Workload(GPT, 64, "bf16", optimizer="muon"), load_cluster("a100-80gb").view(8)),
    )
    layout = Layout(tp=tp, pp=1, dp=8 // tp, micro_batch=1, zero_stage=zero)
    body = GPT.num_layers * muon._params_on_rank(layout)[1] / GPT.num_layers  # the layers, per TP rank
    a, m = adamw.memory(layout, 1, 8), muon.memory(layout, 1, 8)
    assert a["optimizer"] - m["optimizer"] == pytest.approx(4 * body / layout.dp)
    assert m["buffers"] - a["buffers"] == pytest.approx(4 * body * tp)
    ea, em = adamw.evaluate(layout), muon.evaluate(layout)
    comm, ns = muon._muon_time(layout)
    assert comm > 0 and ns > 0
    assert em.dp_comm == pytest.approx(ea.dp_comm + comm)
    assert em.optimizer == pytest.approx(ea.optimizer + ns)
