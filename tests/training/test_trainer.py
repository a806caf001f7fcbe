"""The training loop end to end on one process: accumulation, metrics, NaN handling, exact resume."""

import json
import math

import pytest
import torch

from llmtrain.config import load
from llmtrain.models import build
from llmtrain.models.moe import z_loss
from llmtrain.parallel import Topology, grad_sync
from llmtrain.training import TrainingDiverged
from llmtrain.training.metrics_file import latest_per_step, read_rows
from llmtrain.training.profiling import StepTimer
from llmtrain.training.run import build_trainer, run
from llmtrain.training.trainer import LocalStepRunner
from tests.training._runs import TINY as RUNS_TINY

# The lifecycle tests' tiny job, with two micro-batches per step so that accumulation is exercised.
TINY = [*RUNS_TINY, "train.micro_batch_size=4"]


def tiny_job(tmp_path, *extra):
    return load("configs/ernie.yaml", [*TINY, f"output_dir={tmp_path}", *extra])


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


class _AutogradOptimizer:
    """The part of ModelOptimizer the runner uses, reduced to plain autograd (the reference)."""

    def backward(self, loss):
        loss.backward()


def test_gradient_accumulation_equals_one_big_batch():
    job = load("configs/ernie.yaml", [*TINY, "model.vocab_size=128"])
    torch.manual_seed(0)
    model = build(job.model)
    batch = torch.randint(0, 128, (8, 33))
    model(batch[:, :-1], labels=batch[:, 1:]).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    runner = LocalStepRunner(model, _AutogradOptimizer(), micro_batch_size=2, grad_sync=grad_sync)
    loss = runner.train_step(batch, StepTimer(enabled=False))
    assert math.isfinite(float(loss))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_moe_step_reports_aux_loss_and_expert_load():
    """The training loss of a mixture of experts is cross-entropy + router_aux_loss_coef * aux loss; the
    runner reports the micro-batches' mean aux loss and the tokens each expert got (top-k per token)."""
    job = load(
        "configs/ernie.yaml", [*TINY, "model.vocab_size=128", "model.arch=mixtral", "model.num_experts=3"]
    )
    torch.manual_seed(0)
    model = build(job.model)
    batch = torch.randint(0, 128, (8, 33))
    runner = LocalStepRunner(model, _AutogradOptimizer(), micro_batch_size=4, grad_sync=grad_sync)
    loss = runner.train_step(batch, StepTimer(enabled=False))
    figures = runner.router_figures
    assert figures.expert_load.shape == (2, 3)
    assert figures.expert_load.sum(dim=1).tolist() == [8 * 32 * 2] * 2  # every token reaches its top-2
    aux, ce, z, loads = [], [], [], []
    with torch.no_grad():
        for micro in batch.split(4):
            logits = model(micro[:, :-1])
            aux.append(model.aux_loss())
            z.append(z_loss(model.router_stats()))
            loads.append(torch.stack([s.tokens_per_expert for s in model.router_stats()]))
            ce.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten()))
    torch.testing.assert_close(figures.aux_loss, torch.stack(aux).mean())
    torch.testing.assert_close(figures.z_loss, torch.stack(z).mean())
    assert torch.equal(figures.expert_load, sum(loads)) and figures.dropped == 0  # dropless
    expected = torch.stack(ce).mean() + job.model.router_aux_loss_coef * torch.stack(aux).mean()
    # The runner sums the micro-batches' fp32 losses in float64 (the same bits at any split); the fp32
    # reference mean is within fp32's rounding of it.
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss.float(), expected)
    metrics = figures.metrics()
    assert metrics["expert_load_mean"] == pytest.approx(8 * 32 * 2 / 3)
    assert metrics["expert_load_mean"] <= metrics["expert_load_max"] <= 8 * 32
    per_layer = figures.expert_load.max(dim=1).values / (8 * 32 * 2 / 3)
    assert metrics["expert_load_layers"] == pytest.approx(per_layer.tolist(), abs=1e-4)
    assert metrics["z_loss"] > 0 and metrics["dropped_fraction"] == 0


@pytest.mark.slow
def test_moe_run_logs_router_metrics(tmp_path):
    run(
        tiny_job(tmp_path, "model.arch=mixtral", "model.num_experts=3", "train.steps=2", "logging.interval=1")
    )
    train = [e for e in read_metrics(tmp_path) if "eval_loss" not in e]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        assert entry["aux_loss"] > 0 and entry["expert_load_max"] >= entry["expert_load_mean"] > 0


# A tiny DeepSeek-V3: latent attention with a low-rank query, a dense first layer, grouped sigmoid routing.
DEEPSEEK = [
    "model.arch=deepseek_v3",
    "model.num_kv_heads=null",
    "model.q_lora_rank=24",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=16",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_ffn_hidden_size=32",
    "model.num_shared_experts=1",
    "model.num_expert_groups=2",
    "model.topk_expert_groups=1",
    "model.routed_scaling_factor=2.5",
]


@pytest.fixture
def one_thread():
    """torch's intra-op threads at train.num_threads=1 (what `run` sets for the tiny jobs), restored after:
    a reduction split over another number of threads rounds differently, so runs compared bitwise must
    use the same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_score_bias_update_is_checkpointed_and_resumes_exactly(tmp_path, one_thread):
    """deepseek_v3 moves its routers' score biases by +-rate per expert after every applied step (the rate
    set high to show in few steps), the checkpoint carries them, and a resumed run equals a straight one;
    the router figures (z-loss, dropped fraction, per-layer load) reach metrics.jsonl."""
    common = [
        *DEEPSEEK,
        "model.router_bias_update_rate=0.01",
        "model.moe_capacity_factor=1.0",
        "logging.interval=1",
        "train.eval_interval=0",
        "checkpoint.interval=2",
    ]
    straight = build_trainer(tiny_job(tmp_path / "straight", "train.steps=4", *common), Topology.single())
    straight.fit()
    straight.metrics.close()
    biases = [r.score_bias.detach().clone() for r in straight.model.routers()]
    steps = (torch.stack(biases) / 0.01).round()  # each expert's net count of +-rate moves
    assert torch.allclose(torch.stack(biases), steps * 0.01) and steps.abs().max() <= 4 and steps.any()
    run(tiny_job(tmp_path / "stopped", "train.steps=2", *common))
    resumed = build_trainer(tiny_job(tmp_path / "stopped", "train.steps=4", *common), Topology.single())
    resumed.restore(tmp_path / "stopped" / "checkpoints" / "step_2")
    saved = [r.score_bias.detach().clone() for r in resumed.model.routers()]
    assert any(b.abs().sum() > 0 for b in saved), "the step-2 checkpoint holds the updated biases"
    resumed.fit()
    resumed.metrics.close()
    assert all(torch.equal(a, r.score_bias) for a, r in zip(biases, resumed.model.routers(), strict=True))
    entries = read_metrics(tmp_path / "straight")
    resumed_losses = [e["loss"] for e in latest_per_step(read_rows(tmp_path / "stopped"))]
    assert resumed_losses == [e["loss"] for e in entries]
    for entry in entries:
        assert entry["z_loss"] > 0 and 0 <= entry["dropped_fraction"] < 1
        assert len(entry["expert_load_layers"]) == 2 and min(entry["expert_load_layers"]) >= 1


def _bias_worker(rank, world, out, *extra):
    """Each MoE layer's score bias after 3 steps, by its row in the model's MoE layers (this rank's)."""
    torch.set_num_threads(1)
    job = tiny_job(
        out, *DEEPSEEK, "model.router_bias_update_rate=0.01", "train.steps=3", "train.eval_interval=0", *extra
    )
    trainer = build_trainer(job, Topology(job.parallel, world, rank))
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.checkpointer.close()
    model = trainer.model
    rows = model.router_rows() if hasattr(model, "router_rows") else range(len(model.routers()))
    return {row: r.score_bias.detach().clone() for row, r in zip(rows, model.routers(), strict=True)}


def _same_biases(got, want):
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


Z_LOSS = "model.router_z_loss_coef=0.01"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-process runs of the score-bias tests, dp=2 and pp=2, in turn in one spawned gloo group (starting
    two processes costs more than both runs); called with a case's name and its output folder."""
    from tests.parallel._dist import SpawnedCases

    root = tmp_path_factory.mktemp("two_ranks")
    cases = {"dp2": (2, (str(root / "dp2"),)), "pp2": (2, (str(root / "pp2"), "parallel.pp=2", Z_LOSS))}
    spawned = SpawnedCases(_bias_worker, cases)
    return lambda name: (spawned(name), root / name)


@pytest.mark.slow
def test_score_bias_update_agrees_over_data_parallel_replicas(tmp_path, two_ranks):
    """dp=2: each replica routes its half of the batch, and the update follows the load summed over both, so
    the replicas keep one bias, the one a single process makes from the whole batch."""
    two, _ = two_ranks("dp2")
    one = _bias_worker(0, 1, str(tmp_path / "dp1"))
    assert any(b.any() for b in one.values())
    for replica in two:
        assert _same_biases(replica, one)


@pytest.mark.slow
def test_score_bias_update_and_router_figures_under_pipeline_stages(tmp_path, two_ranks):
    """pp=2 (one MoE layer per stage, z-loss on): each stage moves its own layers' biases as one process
    does, and rank 0 logs every layer's router figures, the whole model's aux and z losses included."""
    stages, pp2 = two_ranks("pp2")
    one = _bias_worker(0, 1, str(tmp_path / "pp1"), Z_LOSS)
    assert any(b.any() for b in one.values()) and len(one) == 2
    assert not stages[0].keys() & stages[1].keys()
    assert _same_biases({**stages[0], **stages[1]}, one)
    piped, single = read_metrics(pp2), read_metrics(tmp_path / "pp1")
    assert [e["step"] for e in piped] == [e["step"] for e in single]
    for a, b in zip(piped, single, strict=True):
        assert a["expert_load_layers"] == b["expert_load_layers"]
        assert (a["expert_load_max"], a["dropped_fraction"]) == (b["expert_load_max"], b["dropped_fraction"])
        # fp32 sums in another order (over stages): a relative gap of 1e-4 as the equivalence tests allow.
        for key in ("loss", "aux_loss", "z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key


@pytest.mark.slow
def test_run_writes_metrics_and_learns(tmp_path):
    result = run(tiny_job(tmp_path, "train.steps=12", "logging.interval=5", "train.eval_interval=6"))
    entries = read_metrics(tmp_path)
    train = [e for e in entries if "eval_loss" not in e]
    evals = [e for e in entries if "eval_loss" in e]
    assert [e["step"] for e in train] == [5, 10, 12]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "elapsed_s"):
        assert all(key in e for e in train), key
    assert [e["step"] for e in evals] == [6, 12]
    assert train[-1]["loss"] < train[0]["loss"]
    assert result.steps == 12 and result.final_eval_loss == pytest.approx(evals[-1]["eval_loss"])
    assert (tmp_path / "checkpoints" / "latest").exists()


class _NaNAt:
    """Wraps a step runner so that chosen steps produce a NaN loss."""

    def __init__(self, runner, bad_calls):
        self.runner, self.bad_calls, self.calls = runner, set(bad_calls), 0

    def train_step(self, batch, timer):
        self.calls += 1
        loss = self.runner.train_step(batch, timer)
        return loss * float("nan") if self.calls in self.bad_calls else loss

    def eval_step(self, batch):
        return self.runner.eval_step(batch)


@pytest.mark.slow
def test_nan_step_is_skipped_and_counted(tmp_path):
    trainer = build_trainer(
        tiny_job(tmp_path, "train.steps=5", "logging.interval=1", "train.eval_interval=0"), Topology.single()
    )
    trainer.runner = _NaNAt(trainer.runner, bad_calls={3})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    trainer.metrics.close()
    entries = read_metrics(tmp_path)
    assert result.skipped_steps == 1 and entries[-1]["skipped_steps"] == 1
    assert entries[2]["skipped_steps"] == 1 and entries[1]["skipped_steps"] == 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_too_many_bad_steps_stop_the_run(tmp_path):
    job = tiny_job(tmp_path, "train.steps=6", "train.max_bad_steps=2", "train.eval_interval=0")
    trainer = build_trainer(job, Topology.single())
    trainer.runner = _NaNAt(trainer.runner, bad_calls={2, 3})
    with pytest.raises(TrainingDiverged, match="2 steps in a row"):
        trainer.fit()
    trainer.metrics.close()


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path):
    common = [
        "logging.interval=1",
        "train.eval_interval=0",
        "checkpoint.interval=3",
        "model.hidden_dropout=0.1",
    ]
    run(tiny_job(tmp_path / "straight", "train.steps=6", *common))
    run(tiny_job(tmp_path / "stopped", "train.steps=3", *common))
    job = tiny_job(tmp_path / "stopped", "train.steps=6", *common)
    trainer = build_trainer(job, Topology.single())
    trainer.runner = _NaNAt(trainer.runner, bad_calls=())
    trainer.restore(tmp_path / "stopped" / "checkpoints" / "step_3")
    trainer.fit()
    trainer.metrics.close()
    assert trainer.runner.calls == 3, "the second run must resume at step 3, not start over"
    straight = [e["loss"] for e in read_metrics(tmp_path / "straight")]
    resumed = [e["loss"] for e in latest_per_step(read_rows(tmp_path / "stopped"))]
    assert len(straight) == 6
    assert resumed == straight
