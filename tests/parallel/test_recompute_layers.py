"""model.recompute_layers: each layer recomputes as its own entry says, with the uniform run's loss and
gradients, and the trainer's pipeline split honours parallel.stage_layers (one process: partition only)."""

import pytest
import torch

from llmtrain import models
from llmtrain.config import ConfigError, validate
from llmtrain.config.schema import JobConfig, ModelConfig
from llmtrain.parallel import apply_recompute
from llmtrain.pipeline.partition import partition_layers

MODES = ["full", "none", "selective", "none"]


def _model(per_layer: list[str]) -> tuple[torch.nn.Module, list[list[str]]]:
    """A 4-layer gpt with dropout (recomputation must replay the masks) and, per layer, a log of the forward
    passes its block and its attention core run, recorded under the wrappers apply_recompute installs."""
    cfg = ModelConfig(
        arch="gpt", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
        kernels="torch", hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = models.build(cfg)
    calls: list[list[str]] = [[] for _ in model.layers]
    for i, block in enumerate(model.layers):
        # Wrapped before apply_recompute, so a recomputation re-enters (and logs) them.
        block.forward = _logged(block.forward, calls[i], "block")
        block.attn.core = _logged(block.attn.core, calls[i], "core")
    apply_recompute(model, "none", per_layer)
    return model, calls


def _logged(fn, log: list[str], name: str):  # noqa: ANN001, ANN202
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        log.append(name)
        return fn(*args, **kwargs)

    return call


def _loss_and_grads(per_layer: list[str]) -> tuple[float, dict[str, torch.Tensor], list[list[str]]]:
    model, calls = _model(per_layer)
    model.train()
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the same dropout masks in every run
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls


def test_each_layer_recomputes_as_its_entry_says_with_the_uniform_loss_and_gradients():
    loss, grads, _ = _loss_and_grads(["none"] * 4)
    mixed_loss, mixed_grads, calls = _loss_and_grads(MODES)
    # Recomputation replays the same operations on the same inputs with the same dropout masks: bitwise.
    assert mixed_loss == loss
    for name, g in grads.items():
        torch.testing.assert_close(mixed_grads[name], g, rtol=0, atol=0, msg=name)
    # full: the block runs twice (its core with it); selective: only the core again; none: once each.
    assert calls == [
        ["block", "core", "block", "core"],
        ["block", "core"],
        ["block", "core", "core"],
        ["block", "core"],
    ]


def test_recompute_layers_and_stage_layers_are_validated_naming_the_field():
    job = JobConfig(model=ModelConfig(num_layers=4, recompute_layers=["full", "none"]))
    with pytest.raises(ConfigError, match="model.recompute_layers has 2 entries"):
        validate(job)
    job = JobConfig(model=ModelConfig(num_layers=4, recompute_layers=["full", "none", "all", "none"]))
    with pytest.raises(ConfigError, match="'all'"):
        validate(job)
    job = JobConfig(model=ModelConfig(num_layers=4))
    job.parallel.pp, job.parallel.stage_layers = 2, [3, 2]
    with pytest.raises(ConfigError, match="summing to model.num_layers=4"):
        validate(job)
    job.parallel.stage_layers = [3, 1]
    validate(job)


def test_stage_layers_replace_the_computed_split():
    assert partition_layers(8, 3, head_cost=2.0, sizes=[1, 5, 2]) == [range(0, 1), range(1, 6), range(6, 8)]
    with pytest.raises(ConfigError, match="parallel.stage_layers"):
        partition_layers(8, 3, sizes=[4, 4])
