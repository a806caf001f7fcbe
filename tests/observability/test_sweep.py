"""Sweeps: grid parsing, a four-point sweep with one invalid setting, re-runs skipping finished points."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.sweep import load_list, parse_grid
from llmtrain.sweep.runner import RECORD, build_command
from llmtrain.sweep.summary import PLOTS

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
    with pytest.raises(ValueError, match=message):
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
    with pytest.raises(ValueError, match="list of mappings"):
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
    """tools/pretrain.py itself on a 1-layer, 32-wide GPT: four points, one invalid, then a re-run."""
    base = tmp_path / "tiny.yaml"
    base.write_text(
        "model: {arch: gpt, num_layers: 1, hidden_size: 32, num_attention_heads: 2, seq_length: 32,"
        " kernels: torch}\n"
        "train: {steps: 3, warmup_steps: 1, eval_interval: 3, eval_batches: 1}\n"
        "logging: {interval: 1}\n"
    )
    out = tmp_path / "sweep"
    command = [
        sys.executable,
        str(ROOT / "tools" / "sweep.py"),
        "--config",
        str(base),
        "--grid",
        "train.global_batch_size=2,3 train.micro_batch_size=1,2",
        "--output",
        str(out),
        "--parallel",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two runs at once on two cores
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert first.returncode == 1, first.stdout + first.stderr
    rows = _read_csv(out / "summary.csv")
    assert [r["status"] for r in rows.values()].count("done") == 3, first.stdout
    bad = rows["global_batch_size-3_micro_batch_size-2"]
    assert bad["status"] == "failed" and "global_batch_size=3" in bad["error"]
    for row in rows.values():
        if row["status"] == "done":
            assert 0 < float(row["final_loss"]) < 20 and float(row["tokens_per_sec"]) > 0
            assert 0 < float(row["mfu"]) < 1
    assert (out / "summary.md").exists() and (out / PLOTS[0]).exists()
    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert second.stdout.count("already finished, skipped") == 3, second.stdout + second.stderr
