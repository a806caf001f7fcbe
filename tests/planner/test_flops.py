"""FLOPs and parameter counts against published formulas and published model sizes."""

from dataclasses import replace

import pytest

from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cost.flops import (
    megatron_flops_per_iteration,
    model_flops_per_token,
    num_parameters,
    training_flops_per_token,
)


def gpt(layers=24, hidden=2304, heads=24, vocab=51200, seq=2048):
    return ModelConfig(
        arch="gpt",
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=vocab,
        seq_length=seq,
    )


@pytest.mark.parametrize("layers,hidden,heads", [(24, 2304, 24), (128, 25600, 160), (4, 256, 4)])
def test_full_recompute_matches_megatron_formula(layers, hidden, heads):
    # Narayanan et al. 2021, eq. 3: 96*B*s*l*h^2*(1 + s/(6h) + V/(16lh)), 4 passes of the layers.
    m, batch = gpt(layers, hidden, heads), 8
    expected = (
        96 * batch * 2048 * layers * hidden**2 * (1 + 2048 / (6 * hidden) + 51200 / (16 * layers * hidden))
    )
    got = training_flops_per_token(m, recompute="full") * batch * 2048
    assert got == pytest.approx(expected, rel=1e-12)
    assert megatron_flops_per_iteration(batch, 2048, layers, hidden, 51200) == pytest.approx(
        expected, rel=1e-12
    )


def test_model_flops_are_three_passes():
    # Without recomputation: 72*B*s*l*h^2*(1 + s/(6h) + V/(12lh)) (the same paper, 3 passes).
    m = gpt()
    expected = 72 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (12 * 24 * 2304))
    assert model_flops_per_token(m) * 2048 == pytest.approx(expected, rel=1e-12)
    assert training_flops_per_token(m, recompute="none") == model_flops_per_token(m)
    # Selective recompute adds the attention core's forward (4*s*h per token per layer, Korthikanti et al.).
    extra = training_flops_per_token(m, recompute="selective") - model_flops_per_token(m)
    assert extra == pytest.approx(24 * 4 * 2048 * 2304)


def test_gated_mlp_and_gqa_flops():
    # LLaMA-style: q/o h*h, k/v h*(kv*d), SwiGLU 3 matrices of h x ffn; 6 FLOPs per weight + attention.
    m = ModelConfig(
        arch="llama",
        num_layers=2,
        hidden_size=512,
        num_attention_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=1408,
        vocab_size=1000,
        seq_length=128,
    )
    weights_per_layer = 512 * 512 * 2 + 2 * 512 * 128 + 3 * 512 * 1408
    expected = 3 * (2 * (2 * weights_per_layer + 4 * 128 * 512) + 2 * 512 * 1000)
    assert model_flops_per_token(m) == pytest.approx(expected)


@pytest.mark.parametrize(
    "cfg,published",
    [
        # GPT-2 small (tied, learned positions, biases, LayerNorm): 124,439,808 parameters.
        (
            dict(
                arch="gpt",
                num_layers=12,
                hidden_size=768,
                num_attention_heads=12,
                vocab_size=50257,
                seq_length=1024,
            ),
            124_439_808,
        ),
        # LLaMA-2 7B: 6,738,415,616 parameters.
        (
            dict(
                arch="llama",
                num_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                ffn_hidden_size=11008,
                vocab_size=32000,
                seq_length=4096,
            ),
            6_738_415_616,
        ),
        # Llama-3 8B (GQA with 8 kv heads): 8,030,261,248 parameters.
        (
            dict(
                arch="llama",
                num_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                num_kv_heads=8,
                ffn_hidden_size=14336,
                vocab_size=128256,
                seq_length=8192,
            ),
            8_030_261_248,
        ),
    ],
)
def test_parameter_counts_match_published_models(cfg, published):
    assert num_parameters(ModelConfig(**cfg)) == published


@pytest.mark.slow  # imports torch and the model zoo
@pytest.mark.parametrize("arch", ["gpt", "llama", "ernie"])
def test_parameter_count_matches_built_model(arch):
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("llmtrain.models")
    cfg = ModelConfig(
        arch=arch,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        vocab_size=300,
        seq_length=16,
    )
    with torch.device("meta"):
        model = models.build(cfg)
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # builds each full-size model of transformers on the meta device (DeepSeek-V3: ~10 s)
@pytest.mark.parametrize("preset", ["deepseek-v3", "ernie-4.5-21b-a3b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_preset_parameter_counts_equal_transformers(preset):
    """The full-size MoE presets against the transformers model of their exported config: DeepSeek-V3 671.0B
    (its multi-token-prediction module aside), Mixtral-8x7B 46,702,792,704, Qwen3-30B-A3B 30.5B, ERNIE-4.5
    21.8B, less ERNIE's router score biases, which transformers holds as parameters and llmtrain freezes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llmtrain.config import load
    from llmtrain.models.hf import to_hf_config

    cfg = load(f"configs/{preset}.yaml").model
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**to_hf_config(cfg))
        )
    frozen = sum(p.numel() for n, p in model.named_parameters() if n.endswith("e_score_correction_bias"))
    # transformers builds no multi-token prediction module (model.mtp_layers; counted in its own test).
    main = replace(cfg, mtp_layers=0)
    assert num_parameters(main) == sum(p.numel() for p in model.parameters()) - frozen


@pytest.mark.slow  # builds and runs four small models (seconds on shared cores)
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_mtp_modules_counted_like_torch_counts_them(arch):
    # model.mtp_layers: parameters exactly as the built model holds them (MoE block where layer
    # num_layers + depth is one); forward FLOPs by torch's counter over our training forward, with and
    # without the modules: each depth costs one layer as counted for the main layers (the counter's
    # attention core included), eh_proj (2h -> h) and one more pass through the output layer. The dense
    # arch only for FLOPs: the counter sees the routed experts the tokens chose, not the planner's top-k.
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrain.models import build
    from llmtrain.planner.cost import flops as F
    from tests.parallel._dist import tiny_job

    counted = {}
    for depth in (0, 2):
        cfg = tiny_job(arch, mtp_layers=depth).model
        model = build(cfg, seed=0)
        assert F.num_parameters(cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)
        ids = torch.randint(
            0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(ids[:, :-1], labels=ids[:, 1:])
        counted[depth] = counter.get_total_flops() / (2 * cfg.seq_length)
    if arch != "llama":
        return
    h, logits = cfg.hidden_size, F.logits_flops_per_token(cfg)
    layer = (counted[0] - logits) / cfg.num_layers
    assert counted[2] - counted[0] == pytest.approx(2 * (layer + 4 * h * h + logits), rel=1e-12)
    planned = F.layer_flops_per_token(cfg).total + 4 * h * h + logits
    assert F.mtp_flops_per_token(cfg) == 2 * planned
    assert (
        F.forward_flops_per_token(cfg) == F.forward_flops_per_token(replace(cfg, mtp_layers=0)) + 2 * planned
    )
