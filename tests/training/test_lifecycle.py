"""An output directory across launches, in-process: nothing to do, refusals that write nothing, kept
configs, append-only metrics with segments, resume=false, archive_existing, checkpoint.load vs the run's own
checkpoint, the startup block, checkpoint-saved lines, the interval-averaged loss and time-based saves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from llmtrain.checkpoint import CheckpointError
from llmtrain.config import CheckpointConfig, ConfigError, load
from llmtrain.data import DataError
from llmtrain.models import build
from llmtrain.training.metrics_file import latest_per_step, read_rows
from llmtrain.training.output_dir import plan_launch
from llmtrain.training.run import run
from tests.training._runs import CONFIG, ROOT, TINY, tree_digest

QUIET = ["train.eval_interval=0", "logging.interval=1"]


def job(out: Path, *overrides: str):
    return load(CONFIG, [*TINY, f"output_dir={out}", *overrides])


def train(out: Path, capsys: pytest.CaptureFixture, *overrides: str):
    """run() the tiny job; returns (TrainResult, its stdout)."""
    result = run(job(out, *overrides))
    return result, capsys.readouterr().out


@pytest.mark.slow
def test_rerun_resumes_then_has_nothing_to_do(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    first, _ = train(out, capsys, "train.steps=3", *QUIET)
    assert (first.steps, first.steps_run, first.exit_code) == (3, 3, 0)
    before = tree_digest(out)
    again, text = train(out, capsys, "train.steps=3", *QUIET)
    assert again.summary() == (
        f"{out} is at step 3 of train.steps=3: nothing to do; raise train.steps (e.g. train.steps=6) to "
        "continue, or choose a new output_dir"
    )
    assert (again.steps_run, again.final_loss, again.exit_code) == (0, None, 0)
    assert "nan" not in again.summary().lower() and text == ""
    assert tree_digest(out) == before  # a launch with nothing to do writes nothing
    more, text = train(out, capsys, "train.steps=5", *QUIET)
    assert f"resumed from {out / 'checkpoints' / 'step_3'} at step 3" in text
    assert (more.steps, more.steps_run) == (5, 2)
    assert re.search(r"^done: step 5/5 \(2 steps in [\d.]+s, loss \d+\.\d{4}\); output in ", more.summary())


@pytest.mark.slow
def test_config_yaml_kept_and_metrics_append_only_with_segments(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    train(out, capsys, "train.steps=3", *QUIET)
    config = (out / "config.yaml").read_bytes()
    metrics = (out / "metrics.jsonl").read_bytes()
    train(out, capsys, "train.steps=5", *QUIET)
    train(out, capsys, "train.steps=6", *QUIET)
    assert (out / "config.yaml").read_bytes() == config  # the first launch's config is kept
    assert yaml.safe_load(config)["train"]["steps"] == 3
    assert yaml.safe_load((out / "config.segment1.yaml").read_text())["train"]["steps"] == 5
    assert yaml.safe_load((out / "config.segment2.yaml").read_text())["train"]["steps"] == 6
    assert (out / "metrics.jsonl").read_bytes().startswith(metrics)  # appended to, never rewritten
    rows = read_rows(out)
    assert [(r["step"], r["segment"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 2)]
    launches = [json.loads(line) for line in (out / "launches.jsonl").read_text().splitlines()]
    assert [(r["segment"], r["config"], r["start_step"]) for r in launches] == [
        (0, "config.yaml", 0),
        (1, "config.segment1.yaml", 3),
        (2, "config.segment2.yaml", 5),
    ]


@pytest.mark.slow
def test_relaunch_redoing_steps_keeps_old_rows_and_readers_take_the_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A launch that died after its last checkpoint logged steps the next launch runs again: both rows
    stay in metrics.jsonl, and latest_per_step reads the second launch's."""
    out = tmp_path / "run"
    train(out, capsys, "train.steps=4", "checkpoint.interval=2", *QUIET)
    # As if the launch had died after step 4 was logged but before its checkpoint was published.
    checkpoints = out / "checkpoints"
    (checkpoints / "latest").write_text("step_2\n")
    train(out, capsys, "train.steps=4", *QUIET)
    rows = read_rows(out)
    assert [(r["step"], r["segment"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (4, 0), (3, 1), (4, 1)]
    latest = latest_per_step(rows)
    assert [(r["step"], r["segment"]) for r in latest] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    # Deterministic training: the redone steps have the same losses as the first time.
    assert [r["loss"] for r in rows[2:4]] == [r["loss"] for r in rows[4:]]


def test_refused_run_writes_nothing(tmp_path: Path) -> None:
    """Config and world-size validation refuse before anything exists: no directory, no file."""
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide"):
        run(job(out, "parallel.tp=3"))
    with pytest.raises(ConfigError, match="make the product equal the world size"):
        run(job(out, "parallel.dp=2"))
    assert not out.exists()


@pytest.mark.slow
def test_resume_false_in_a_directory_holding_a_run_is_refused_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    train(out, capsys, "train.steps=2", *QUIET)
    before = tree_digest(out)
    with pytest.raises(ConfigError) as refused:
        run(job(out, "train.steps=4", "checkpoint.resume=false", *QUIET))
    message = str(refused.value)
    assert f"output_dir={out} holds a run" in message and "checkpoint.resume=false" in message
    assert "choose a new output_dir" in message and "checkpoint.archive_existing=true" in message
    assert tree_digest(out) == before  # metrics not truncated, latest not moved, config kept
    # In a fresh directory resume=false is simply a fresh start.
    fresh, _ = train(tmp_path / "fresh", capsys, "train.steps=2", "checkpoint.resume=false", *QUIET)
    assert fresh.steps_run == 2


@pytest.mark.slow
def test_launch_failing_after_the_checks_of_the_config_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A launch whose checkpoint does not fit its model, or whose data is missing, fails before it commits:
    no config, launch row, metrics row or directory is added."""
    out = tmp_path / "run"
    train(out, capsys, "train.steps=2", *QUIET)
    before = tree_digest(out)
    with pytest.raises(CheckpointError, match="model.num_layers=2, this job has model.num_layers=3"):
        run(job(out, "train.steps=4", "model.num_layers=3", *QUIET))
    with pytest.raises(DataError, match="does not exist"):
        run(job(out, "train.steps=4", f"data.tokenizer={tmp_path / 'missing.model'}", *QUIET))
    assert tree_digest(out) == before
    with pytest.raises(DataError):
        run(job(tmp_path / "fresh", f"data.tokenizer={tmp_path / 'missing.model'}"))
    assert not (tmp_path / "fresh").exists()


@pytest.mark.slow
def test_archive_existing_moves_the_earlier_run_aside_and_starts_fresh(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    train(out, capsys, "train.steps=3", *QUIET)
    before = tree_digest(out)
    result, text = train(out, capsys, "train.steps=2", "checkpoint.archive_existing=true", *QUIET)
    (archive,) = (out / "archive").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", archive.name)
    assert tree_digest(archive) == before  # the earlier run, every byte of it
    assert f"moved to {archive}" in text and "fresh at step 0" in text
    assert (result.steps, result.steps_run) == (2, 2)
    assert [(r["step"], r["segment"]) for r in read_rows(out)] == [(1, 0), (2, 0)]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 2


@pytest.mark.slow
def test_own_checkpoint_wins_over_checkpoint_load(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "pretrained"
    train(source, capsys, "train.steps=2", *QUIET)
    load_from = f"checkpoint.load={source / 'checkpoints' / 'step_2'}"
    finetune = tmp_path / "finetune"
    _, text = train(finetune, capsys, "train.steps=4", "checkpoint.interval=3", load_from, *QUIET)
    assert f"resumed from {source / 'checkpoints' / 'step_2'} at step 2 (checkpoint.load)" in text
    # The fine-tune was cut short after its step-3 checkpoint: rerunning continues it, not the source.
    (finetune / "checkpoints" / "latest").write_text("step_3\n")
    _, text = train(finetune, capsys, "train.steps=4", load_from, *QUIET)
    assert f"resumed from {finetune / 'checkpoints' / 'step_3'} at step 3;" in text


def test_startup_block_and_checkpoint_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    _, text = train(out, capsys, "train.steps=4", "checkpoint.interval=2", *QUIET)
    lines = text.splitlines()
    block = dict(line.split(None, 1) for line in lines[:6])
    assert list(block) == ["model", "layout", "batch", "precision", "output", "start"]
    params = sum(p.numel() for p in build(job(out).model).parameters())  # the real module's count
    assert block["model"].startswith("ernie: 2 layers, hidden 64, 4 heads (2 kv), ffn 128, vocab 8192; ")
    assert block["model"].endswith(f"; {params / 1e6:.2f}M parameters")
    assert block["layout"] == "tp 1 x pp 1 x dp 1 = 1 process, zero stage 0"
    assert block["batch"] == (
        "micro 2 x 4 accumulation x dp 1 = global 8 samples x 32 tokens = 256 tokens per step"
    )
    assert block["precision"] == "fp32, kernels torch (model.kernels=auto)"
    assert block["output"].startswith(f"{out} (segment 0, config config.yaml); checkpoints every 2 steps")
    assert block["start"] == "fresh at step 0; training to step 4"
    saved = [line for line in lines if line.startswith("checkpoint saved: ")]
    assert len(saved) == 2
    for step, line in zip((2, 4), saved, strict=True):
        assert re.fullmatch(
            rf"checkpoint saved: {re.escape(str(out))}/checkpoints/step_{step} in [\d.]+s", line
        )
    assert (out / "checkpoints" / "step_2" / "manifest.json").is_file()
    assert (out / "checkpoints" / "step_4" / "manifest.json").is_file()


@pytest.mark.slow
def test_progress_loss_is_the_mean_over_the_logging_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Reference: the same deterministic run logged every step; the interval-3 line shows their mean."""
    train(tmp_path / "every", capsys, "train.steps=6", *QUIET)
    per_step = [r["loss"] for r in read_rows(tmp_path / "every")]
    result, text = train(
        tmp_path / "grouped", capsys, "train.steps=6", "train.eval_interval=0", "logging.interval=3"
    )
    rows = read_rows(tmp_path / "grouped")
    assert [r["step"] for r in rows] == [3, 6]
    for row, window in zip(rows, (per_step[:3], per_step[3:]), strict=True):
        assert row["loss"] == window[-1]
        assert row["loss_avg"] == pytest.approx(sum(window) / 3, rel=1e-12)
    progress = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[1] for line in progress] == [f"loss {r['loss_avg']:.4f}" for r in rows]
    assert result.final_loss == rows[-1]["loss_avg"]
    for line in progress:  # no peak is known for a CPU: no MFU, and everything else
        assert "MFU" not in line
        for part in ("lr ", "grad ", "tok/s", "TFLOP/s/dev", "mem ", "ETA "):
            assert part in line, (part, line)
    assert all(r["mfu"] is None and r["mfu_peak"] is None for r in rows)


@pytest.mark.slow
def test_wall_clock_interval_saves_between_step_intervals(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """checkpoint.interval_minutes saves once that much time passed since the last save (here 0.6 ms:
    after every step), whatever checkpoint.interval says."""
    _, text = train(
        tmp_path / "run", capsys, "train.steps=3", "checkpoint.interval=0", "checkpoint.interval_minutes=1e-5"
    )
    assert [
        line.split(" in ")[0][-6:] for line in text.splitlines() if line.startswith("checkpoint saved")
    ] == [
        "step_1",
        "step_2",
        "step_3",
    ]


def test_model_parameter_count_matches_the_module() -> None:
    """The startup block's count (planner.flops.num_parameters) against the built module's trainable
    parameters (ERNIE-MoE's router score bias is frozen), for each arch, MoE layouts with dense layers too."""
    from llmtrain.planner.cost.flops import num_parameters

    moe = ["model.num_layers=3", "model.num_experts=5", "model.moe_ffn_hidden_size=24"]
    latent = ["kv_lora_rank=10", "qk_nope_head_dim=6", "qk_rope_head_dim=4", "v_head_dim=7"]
    deepseek = [f"model.{f}" for f in latent] + ["model.moe_layer_start=1", "model.num_kv_heads=null"]
    for arch, extra in [
        ("gpt", []),
        ("llama", []),
        ("ernie", []),
        ("mixtral", moe),
        ("qwen3_moe", [*moe, "model.dense_layers=[1]", "model.num_experts_per_tok=3"]),
        ("ernie_moe", [*moe, "model.moe_layer_start=1", "model.num_shared_experts=2"]),
        ("deepseek_v3", [*moe, *deepseek, "model.q_lora_rank=12", "model.num_shared_experts=1"]),
        ("deepseek_v3", [*moe, *deepseek]),
    ]:
        model = load(CONFIG, [*TINY, f"model.arch={arch}", *extra]).model
        trainable = sum(p.numel() for p in build(model).parameters() if p.requires_grad)
        assert num_parameters(model) == trainable, arch


@pytest.mark.slow
def test_torchrun_restart_continues_its_own_run_only(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An elastic restart (TORCHELASTIC_RESTART_COUNT > 0) of the job that last committed to output_dir
    resumes it even with archive_existing or resume=false; a restart of another job is treated like any
    new launch."""
    out = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    train(out, capsys, "train.steps=2", "checkpoint.archive_existing=true", *QUIET)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for flag in ("checkpoint.archive_existing=true", "checkpoint.resume=false"):
        launch = plan_launch(job(out, "train.steps=4", flag))
        assert (launch.archive_to, launch.start_step, launch.segment) == (None, 2, 1), flag
        assert launch.resume_from == str(out / "checkpoints" / "step_2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    assert plan_launch(job(out, "train.steps=4", "checkpoint.archive_existing=true")).archive_to is not None
    with pytest.raises(ConfigError, match="holds a run"):
        plan_launch(job(out, "train.steps=4", "checkpoint.resume=false"))


def test_periodic_checkpoints_are_on_by_default_and_in_every_shipped_config() -> None:
    assert CheckpointConfig().interval > 0 and CheckpointConfig().interval_minutes > 0
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(shipped) >= 6
    for path in shipped:
        saved = load(path).checkpoint
        assert saved.interval > 0 and saved.interval_minutes > 0, path
