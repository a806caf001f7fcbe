"""tools/plan.py end to end: table, JSON, --evaluate, --write, --plot, --profile-local, errors."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from llmtrain.config import load, validate_world
from llmtrain.planner import validation
from llmtrain.planner.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
plan_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_tool)


@pytest.fixture
def model_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"arch": "llama", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16,
                          "num_kv_heads": 4, "vocab_size": 32000, "seq_length": 2048},
                "train": {"global_batch_size": 128, "micro_batch_size": 1, "precision": "bf16"},
            }
        )
    )  # fmt: skip
    return path


def test_json_evaluate_write_and_plot(model_yaml, tmp_path, capsys):
    best, png = tmp_path / "best.yaml", tmp_path / "plan.png"
    argv = ["--config", str(model_yaml), "--cluster", "a100-80gb", "--gpus", "16", "--top", "3", "--json",
            "--evaluate", "parallel.tp=2 parallel.pp=2",
            "--write", str(best), "--plot", str(png)]  # fmt: skip
    assert plan_tool.main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 3 and all(r["tp"] == 2 and r["pp"] == 2 and r["dp"] == 4 for r in records)
    assert records[0]["step_time_s"] <= records[1]["step_time_s"]
    job = load(best)
    assert (job.parallel.tp, job.parallel.pp, validate_world(job, 16)) == (2, 2, 4)
    assert png.stat().st_size > 10_000


def test_table_and_clear_errors(model_yaml, capsys):
    assert plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "step_s" in out and "TFLOP/s" in out
    assert plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--cluster", "nowhere.yaml"]) == 2
    assert "nowhere.yaml" in capsys.readouterr().err
    assert plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--evaluate", "parallel.tpp=2"]) == 2
    assert "not a planner setting" in capsys.readouterr().err


def test_missing_reference_table_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(validation, "REPO", tmp_path / "repo")
    with pytest.raises(Exception, match="shared/reference/megatron_a100_2021.csv"):
        validation.reference_path()


@pytest.mark.slow  # two gloo processes
def test_profile_local_writes_a_loadable_cluster(tmp_path, capsys):
    out = tmp_path / "local.yaml"
    assert plan_tool.main(["--profile-local", "--output", str(out)]) == 0
    view = load_cluster(out).view(2)
    assert view.device.peak_tflops["fp32"] > 0 and view.intra.bandwidth_gbs > 0 and view.intra.latency_us > 0
