"""Hugging Face in and out of a run: checkpoint.load=<transformers model directory> starts the run from its
weights (the first step's loss is transformers' loss of that batch), at one process, and for a mixture of
experts at tp=2 x pp=2 x ep=2 (4 ranks: the TP shards, the pipeline's stages and the experts' shards chunked
from the one directory), and
checkpoint.export_hf=true leaves a directory that AutoModelForCausalLM and AutoTokenizer load, whose logits
are the final checkpoint's. The references are transformers' models, built from a config and saved with
save_pretrained (no hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import llmtrain
from llmtrain.config import ConfigError, load
from llmtrain.data import build_data
from llmtrain.models.hf import to_hf_config
from llmtrain.training.hf_io import export
from llmtrain.training.metrics_file import read_rows
from llmtrain.training.output_dir import plan_launch
from llmtrain.training.run import run
from tests.training._runs import CONFIG, TINY, run_cli, torchrun_command

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
QUIET = ["train.eval_interval=0", "logging.interval=1", "train.steps=2"]
# fp32 throughout: the two implementations differ by rounding in their matmul and softmax orders, ~1e-6 of a
# loss of ~9 averaged over 256 tokens and of each logit; 1e-5 leaves room for that and nothing more.
TOL = 1e-5


# ERNIE-4.5-MoE of the tiny shape: layer 0 dense, layer 1 four routed experts (top-2, dropless) and a
# shared one; no load-balancing loss, so the logged loss is the cross-entropy transformers' logits give.
MOE = [
    "model.arch=ernie_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
    "model.moe_ffn_hidden_size=64", "model.num_shared_experts=1", "model.moe_layer_start=1",
    "model.norm_topk_prob=true", "model.router_aux_loss_coef=0.0",
]  # fmt: skip


def job(out: Path, *overrides: str):
    return load(CONFIG, [*TINY, f"output_dir={out}", *overrides])


def transformers_dir(folder: Path, *overrides: str) -> Path:
    """A transformers model of the tiny job's shape (with `overrides`), with transformers' own random
    weights, and beside it the tokenizer the tiny job would train (as a model directory carries its
    tokenizer)."""
    tiny = job(Path("unused"), *overrides)
    fields = to_hf_config(tiny.model)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = folder / fields.get("model_type", "model")
    model.save_pretrained(path)
    for name, data in build_data(tiny, dp_rank=0, dp_size=1).tokenizer.files().items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' ERNIE-4.5 of the tiny job's shape."""
    return transformers_dir(tmp_path_factory.mktemp("hf"))


def transformers_first_loss(hf_dir: Path, out: Path) -> float:
    """transformers' mean next-token loss on the run's first global batch."""
    batch = next(build_data(load(out / "config.yaml"), dp_rank=0, dp_size=1).train_batches(0))
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()


def check_export(exported: Path, checkpoint: str) -> None:
    """transformers loads the export and gives the final checkpoint's logits; its tokenizer the run's ids."""
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    ours = llmtrain.from_pretrained(checkpoint)
    ids = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours(ids), rtol=TOL, atol=TOL)
    text = "def add(a, b):\n    return a + b\n"
    tokenizer = AutoTokenizer.from_pretrained(exported)
    run_tokenizer = build_data(job(Path("unused")), dp_rank=0, dp_size=1).tokenizer
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == run_tokenizer.encode(text)


@pytest.mark.slow
def test_run_starts_from_a_transformers_directory_and_exports_one(tmp_path, hf_dir, capsys):
    out = tmp_path / "run"
    result = run(job(out, f"checkpoint.load={hf_dir}", "checkpoint.export_hf=true", *QUIET))
    text = capsys.readouterr().out
    assert f"fresh at step 0 from the model in {hf_dir} (checkpoint.load)" in text
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["tokenizer"] == str(hf_dir)
    first = next(row for row in read_rows(out) if row["step"] == 1)
    assert first["loss"] == pytest.approx(transformers_first_loss(hf_dir, out), rel=TOL)
    assert not any(p.name.endswith(".hf_import") for p in tmp_path.iterdir())  # the conversion is removed
    assert result.exported_hf == str(out / "hf" / "step_2") and "Hugging Face model" in result.summary()
    check_export(Path(result.exported_hf), result.checkpoint)
    # A second export of the same step never replaces the first.
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(result.exported_hf).iterdir())
    again = export(job(out), result.checkpoint, 2)
    assert again == out / "hf" / "step_2-2"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in Path(result.exported_hf).iterdir()) == before


@pytest.mark.slow
def test_moe_run_at_tp2_pp2_ep2_starts_from_a_transformers_directory_and_exports_one(tmp_path, monkeypatch):
    # One launch of 4 ranks for every sharded load and export: tensor parallel (the dense ERNIE layer 0 and
    # both layers' attention split over the TP pair), the pipeline's stages, and the experts (ep=2 spans
    # the TP ranks) chunked from the one directory, then gathered back into the export. A tp=2-only run
    # of the dense ERNIE loaded and exported the same TP shards: layer 0 here is that model's layer.
    hf_moe = transformers_dir(tmp_path, *MOE)
    out = tmp_path / "run"
    overrides = [f"checkpoint.load={hf_moe}", "checkpoint.export_hf=true", *MOE, *QUIET]
    overrides += ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "parallel.backend=gloo"]
    wandb = ["logging.wandb.project=llmtrain-test"] if importlib.util.find_spec("wandb") else []
    monkeypatch.setenv("WANDB_MODE", "offline")
    done = run_cli(torchrun_command(4, out, *overrides, *wandb))
    assert done.returncode == 0, done.stderr[-3000:]
    if wandb:  # rank 0 alone logs to W&B: one run
        assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    first = next(row for row in read_rows(out) if row["step"] == 1)
    assert first["loss"] == pytest.approx(transformers_first_loss(hf_moe, out), rel=TOL)
    check_export(out / "hf" / "step_2", str(out))


def test_a_model_directory_of_another_shape_names_every_field_to_set(tmp_path, hf_dir):
    with pytest.raises(ConfigError) as err:
        plan_launch(
            job(tmp_path / "run", f"checkpoint.load={hf_dir}", "model.num_layers=3", "model.norm_eps=1e-6")
        )
    assert str(err.value) == (
        f"checkpoint.load={hf_dir} is a Hugging Face model directory whose model differs from this job's "
        "model section; set model.num_layers=2 model.norm_eps=1e-05"
    )
    assert not (tmp_path / "run").exists()


def test_export_of_an_arch_transformers_lacks_is_refused_before_training(tmp_path):
    from llmtrain.training.hf_io import check_export as refuse

    with pytest.raises(ConfigError, match=r"^checkpoint.export_hf=true: .*; set checkpoint.export_hf=false$"):
        refuse(job(tmp_path, "checkpoint.export_hf=true", "model.arch=gpt", "model.use_bias=false"))
