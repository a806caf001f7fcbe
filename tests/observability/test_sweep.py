"""Sweeps: grid parsing, a four-point sweep with one invalid setting, re-runs skipping finished points,
fixed overrides, attempts that keep earlier logs, and summaries that read the latest row per step."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.sweep import RunResult, load_list, parse_grid, run_sweep, summarize
from llmtrain.sweep.errors import SweepError
from llmtrain.sweep.runner import RECORD, build_command, run_metrics
from llmtrain.sweep.summary import PLOTS, loss_curve, result_row

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_pretrain.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_main(argv: list[str]) -> int:
    """tools/sweep.py's main, called in this process (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("sweep_tool", ROOT / "tools" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_parse_grid_is_the_cartesian_product_with_readable_names():
    points = parse_grid("parallel.tp=1,2 train.micro_batch_size=1,2,4")
    assert [p.overrides for p in points] == [
        {"parallel.tp": a, "train.micro_batch_size": b} for a in ("1", "2") for b in ("1", "2", "4")
    ]
    assert points[0].name == "tp-1_micro_batch_size-1"
    assert points[0].args == ["parallel.tp=1", "train.micro_batch_size=1"]


def test_parse_grid_keeps_list_values_whole_and_disambiguates_names():
    points = parse_grid("logging.profile_steps=[2,3],[] train.steps=5")
    assert [p.overrides["logging.profile_steps"] for p in points] == ["[2,3]", "[]"]
    assert len({p.name for p in points}) == 2
    clash = parse_grid("train.seed=1 data.seed=2")  # same last part: full keys in the name
    assert clash[0].name == "train-seed-1_data-seed-2"


@pytest.mark.parametrize(
    "grid, message",
    [
        ("parallel.tp", "key.path=v1,v2"),
        ("parallel.tp=1,,2", "empty value"),
        ("a=1 a=2", "twice"),
        ("", "empty"),
    ],
)
def test_parse_grid_errors_name_the_problem(grid, message):
    with pytest.raises(SweepError, match=message):
        parse_grid(grid)


def test_load_list_reads_mappings_as_override_text(tmp_path):
    path = tmp_path / "points.yaml"
    path.write_text(
        "- {parallel.tp: 2, logging.profile_steps: [3, 4]}\n"
        "- {name: big batch, train.global_batch_size: 32}\n"
    )
    points = load_list(path)
    assert points[0].overrides == {"parallel.tp": "2", "logging.profile_steps": "[3, 4]"}
    assert points[1].name == "big_batch" and points[1].overrides == {"train.global_batch_size": "32"}
    path.write_text("parallel.tp: 2\n")
    with pytest.raises(SweepError, match="list of mappings"):
        load_list(path)
    path.write_text("- {parallel.tp: [2}\n")
    with pytest.raises(
        SweepError, match=r"points.yaml is not valid YAML at line 1, column \d+: expected ','"
    ):
        load_list(path)


def test_launcher_replaces_python(tmp_path):
    point = parse_grid("parallel.tp=2")[0]
    command = build_command(
        Path("/c.yaml"),
        Path("/out/x"),
        point,
        ["train.steps=3"],
        "torchrun --nproc_per_node 2",
        Path("/repo/tools/pretrain.py"),
    )
    assert command == [
        "torchrun",
        "--nproc_per_node",
        "2",
        "/repo/tools/pretrain.py",
        "--config",
        "/c.yaml",
        "output_dir=/out/x",
        "parallel.tp=2",
        "train.steps=3",
    ]


def _read_csv(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as handle:
        return {row["run"]: row for row in csv.DictReader(handle)}


@pytest.mark.slow
def test_sweep_with_one_invalid_point_then_rerun_skips_finished(tmp_path, monkeypatch, capsys):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 5\n  global_batch_size: 4\nlogging:\n  interval: 1\n")
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_PRETRAIN_CALLS", str(calls))
    out = tmp_path / "sweep"
    # global batch 6 is not a multiple of micro-batch 4: that one point is invalid.
    argv = [
        "--config",
        str(base),
        "--grid",
        "train.global_batch_size=4,6 train.micro_batch_size=2,4",
        "--output",
        str(out),
        "--parallel",
        "2",
        "--script",
        str(FAKE),
        "--",
        "train.steps=3",
    ]
    assert sweep_main(argv) == 1  # a failed point makes the sweep exit non-zero, after running the rest
    printed = capsys.readouterr().out
    rows = _read_csv(out / "summary.csv")
    assert list(rows) == [
        "global_batch_size-4_micro_batch_size-2",
        "global_batch_size-4_micro_batch_size-4",
        "global_batch_size-6_micro_batch_size-2",
        "global_batch_size-6_micro_batch_size-4",
    ]
    done = [r for r in rows.values() if r["status"] == "done"]
    failed = [r for r in rows.values() if r["status"] == "failed"]
    assert len(done) == 3 and len(failed) == 1
    bad = failed[0]
    assert bad["run"] == "global_batch_size-6_micro_batch_size-4"
    assert bad["error"].startswith("exit 2: config error: train.global_batch_size=6 is not a multiple")
    record = json.loads((out / bad["run"] / RECORD).read_text())
    assert record["returncode"] == 2 and "config error" in record["stderr_tail"]
    for row in done:  # the fake's figures: loss 10/step + mbs at step 3 (from `-- train.steps=3`), ...
        mbs = int(row["train.micro_batch_size"])
        assert float(row["final_loss"]) == pytest.approx(10 / 3 + mbs)
        assert float(row["tokens_per_sec"]) == pytest.approx(1000 * mbs * 2.5)  # median of steps 2 and 3
        assert float(row["tflops_per_device"]) == pytest.approx(0.001 * mbs * 2.5)
        assert float(row["eval_loss"]) == 1 + mbs and row["steps"] == "3"
    md = (out / "summary.md").read_text()
    assert md.count("| global_batch_size-") == 4 and "config error" in md
    assert "| global_batch_size-4_micro_batch_size-2 | 4 | 2 | done | 3 | 5.333 |" in printed
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert len(calls.read_text().splitlines()) == 3

    assert sweep_main(argv) == 1
    printed = capsys.readouterr().out
    assert printed.count("already finished, skipped") == 3
    assert len(calls.read_text().splitlines()) == 3  # the finished points were not run again
    assert _read_csv(out / "summary.csv")[done[0]["run"]]["final_loss"] == done[0]["final_loss"]


@pytest.mark.slow
def test_real_pretrain_sweep_end_to_end(tmp_path):
    """tools/pretrain.py itself on a 1-layer, 32-wide GPT: two points at once, one invalid, then a re-run.
    One real run and one refused are what the fake sweep above cannot show (pretrain's metrics rows parsed,
    its config error caught); the grid's product, naming and bookkeeping over more points are the fake's:
    each more real point would be one more ~8 CPU-s pretrain launch proving the same."""
    base = tmp_path / "tiny.yaml"
    base.write_text(
        "model: {arch: gpt, num_layers: 1, hidden_size: 32, num_attention_heads: 2, seq_length: 32,"
        " kernels: torch}\n"
        "train: {steps: 3, warmup_steps: 1, eval_interval: 3, eval_batches: 1}\n"
        "logging: {interval: 1, peak_tflops: 1.0}\n"  # CPU has no known peak: MFU needs one
    )
    out = tmp_path / "sweep"
    command = [
        sys.executable,
        str(ROOT / "tools" / "sweep.py"),
        "--config",
        str(base),
        "--grid",
        "train.global_batch_size=2,3 train.micro_batch_size=2",
        "--output",
        str(out),
        "--parallel",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two runs at once on two cores
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert first.returncode == 1, first.stdout + first.stderr
    rows = _read_csv(out / "summary.csv")
    assert [r["status"] for r in rows.values()].count("done") == 1, first.stdout
    bad = rows["global_batch_size-3_micro_batch_size-2"]
    assert bad["status"] == "failed" and "global_batch_size=3" in bad["error"]
    for row in rows.values():
        if row["status"] == "done":
            assert 0 < float(row["final_loss"]) < 20 and float(row["tokens_per_sec"]) > 0
            assert float(row["tflops_per_device"]) > 0 and 0 < float(row["mfu"]) < 1
    assert (out / "summary.md").exists() and (out / PLOTS[0]).exists()
    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert second.stdout.count("already finished, skipped") == 1, second.stdout + second.stderr


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 3\n  global_batch_size: 4\n  min_lr: 0\nlogging:\n  interval: 1\n")
    return base


@pytest.mark.slow  # 2 s: with the whole suite, not the quick subset
def test_fixed_overrides_go_beside_the_grid_or_after_a_double_dash(tmp_path, capsys):
    out = tmp_path / "sweep"
    common = ["--config", str(_base(tmp_path)), "--output", str(out), "--script", str(FAKE)]
    # A float grid in the spellings YAML 1.1 read as strings; the fixed override among the options.
    assert sweep_main([*common[:2], "train.steps=2", "--grid", "train.lr=1e-3,3E-4", *common[2:]]) == 0
    assert "2 of 2 runs finished" in (out / "summary.md").read_text()
    for name in ("lr-1e-3", "lr-3E-4"):
        record = json.loads((out / name / RECORD).read_text())
        assert record["status"] == "done" and record["extra"] == ["train.steps=2"]
        assert record["command"][-2:] == [f"train.lr={name[3:]}", "train.steps=2"]
        assert [row["step"] for row in run_metrics(out / name) if "loss" in row] == [1, 2]
    capsys.readouterr()
    # The same fixed override after `--` is the same sweep: both points count as finished.
    assert sweep_main([*common, "--grid", "train.lr=1e-3,3E-4", "--", "train.steps=2"]) == 0
    assert capsys.readouterr().out.count("already finished, skipped") == 2


@pytest.mark.parametrize(
    "grid, fixed, message",
    [
        ("train.lr=1e-3", ["train.steps"], "fixed override: override 'train.steps' is not of the form"),
        ("train.lr=1e-3", ["train.lr=2e-3"], "train.lr is both swept and fixed"),
        ("train.lr=1e-3", ["output_dir=x"], "output_dir is set by the sweep"),
        ("output_dir=a,b", [], "output_dir is set by the sweep"),
    ],
)
def test_bad_fixed_overrides_are_refused_before_anything_runs(tmp_path, grid, fixed, message):
    with pytest.raises(SweepError, match=message):
        run_sweep(_base(tmp_path), parse_grid(grid), tmp_path / "sweep", extra=fixed, script=FAKE)
    assert not (tmp_path / "sweep").exists()


def test_sweep_tool_prints_one_line_errors(tmp_path):
    command = [sys.executable, str(ROOT / "tools" / "sweep.py"), "--config", str(tmp_path / "missing.yaml")]
    command += ["--grid", "train.lr=1e-3", "--output", str(tmp_path / "sweep")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"sweep: error: config file {tmp_path / 'missing.yaml'} does not exist; pass an ")
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=60)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "SweepError" in debug.stderr


def test_a_rerun_of_a_failed_point_keeps_the_earlier_attempts_logs(tmp_path, monkeypatch):
    out, point = tmp_path / "sweep", parse_grid("train.micro_batch_size=2")
    monkeypatch.setenv("FAKE_PRETRAIN_FAIL", "simulated crash of attempt 1")
    [first] = run_sweep(_base(tmp_path), point, out, script=FAKE, stream=sys.stderr)
    assert first.status == "failed" and first.error == "exit 1: simulated crash of attempt 1"
    assert first.attempt == 1
    monkeypatch.delenv("FAKE_PRETRAIN_FAIL")
    [second] = run_sweep(_base(tmp_path), point, out, script=FAKE, stream=sys.stderr)
    assert second.status == "done" and second.attempt == 2 and second.stderr_tail == ""
    run_dir = out / point[0].name
    stderr = (run_dir / "stderr.log").read_text().splitlines()
    assert [line.split(",")[0] for line in stderr if line.startswith("=====")] == [
        "===== sweep attempt 1",
        "===== sweep attempt 2",
    ]
    assert stderr[1] == "simulated crash of attempt 1"  # attempt 1's output is still there
    stdout = (run_dir / "stdout.log").read_text()
    assert stdout.count("===== sweep attempt") == 2 and stdout.endswith("done: 3 steps\n")
    record = json.loads((run_dir / RECORD).read_text())
    assert record["attempt"] == 2 and record["status"] == "done"
    [earlier] = record["earlier_attempts"]
    assert (earlier["attempt"], earlier["status"], earlier["returncode"]) == (1, "failed", 1)
    assert earlier["error"] == "exit 1: simulated crash of attempt 1"


def _rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize(
    "logged_steps, status, error",
    [
        ([], "failed", "exited 0 but wrote no training rows to metrics.jsonl"),
        ([1, 2], "failed", "exited 0 but metrics.jsonl ends at step 2, not at train.steps=3"),
        ([1, 2, 3, 4], "failed", "exited 0 but metrics.jsonl ends at step 4, not at train.steps=3"),
        ([1, 2, 3], "done", None),  # "nothing to do": the earlier launch's rows are this run's own
    ],
)
def test_a_run_that_exits_0_counts_as_done_only_at_train_steps(tmp_path, logged_steps, status, error):
    """A run tool that trains nothing and exits 0, as tools/pretrain.py does when it has nothing to do."""
    idle = tmp_path / "idle.py"
    idle.write_text("print('nothing to do')\n")
    point = parse_grid("train.micro_batch_size=2")
    _rows(
        tmp_path / "sweep" / point[0].name / "metrics.jsonl", [{"step": s, "loss": 1.0} for s in logged_steps]
    )
    [result] = run_sweep(_base(tmp_path), point, tmp_path / "sweep", script=idle, stream=sys.stderr)
    assert (result.returncode, result.status, result.error) == (0, status, error)
    assert result_row(result)["final_loss"] == (1.0 if logged_steps else None)


def test_summary_and_curve_take_the_latest_row_per_step(tmp_path):
    """Launch 0 logs steps 1-4 and dies; launch 1 resumes from a step-2 checkpoint, redoes 3-4, ends at 6."""
    run_dir = tmp_path / "sweep" / "resumed"

    def train(step: int, segment: int, loss: float, tokens: float) -> dict:
        return {"step": step, "segment": segment, "loss": loss, "tokens_per_sec": tokens, "mfu": tokens / 1e4}

    _rows(
        run_dir / "metrics.jsonl",
        [
            train(1, 0, 9.0, 10.0),  # each launch's first interval carries the warm-up
            train(2, 0, 8.0, 200.0),
            train(3, 0, 7.0, 210.0),
            train(4, 0, 6.0, 220.0),
            {"step": 4, "segment": 0, "eval_loss": 6.5},
            train(3, 1, 7.5, 20.0),
            train(4, 1, 6.6, 300.0),
            {"step": 4, "segment": 1, "eval_loss": 6.9},
            train(5, 1, 5.5, 310.0),
            train(6, 1, 5.0, 320.0),
        ],
    )
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 7, "segment": 1, "lo')  # a line cut short by a crash
    result = RunResult("resumed", {"train.lr": "1e-3"}, "done", 0, metrics=run_metrics(run_dir))
    assert loss_curve(result) == [(1, 9.0), (2, 8.0), (3, 7.5), (4, 6.6), (5, 5.5), (6, 5.0)]
    row = result_row(result)
    assert (row["steps"], row["final_loss"], row["eval_loss"]) == (6, 5.0, 6.9)
    # Steady intervals: steps 2 (launch 0) and 4, 5, 6 (launch 1); not 1 and 3, the launches' first.
    assert row["tokens_per_sec"] == pytest.approx(305.0) and row["mfu"] == pytest.approx(0.0305)
    summarize([result], tmp_path / "sweep")
    rows = _read_csv(tmp_path / "sweep" / "summary.csv")
    assert rows["resumed"]["final_loss"] == "5.0" and rows["resumed"]["steps"] == "6"
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_file()) == sorted(
        ["summary.csv", "summary.md", *PLOTS]
    )  # written through temporary files, none left behind
