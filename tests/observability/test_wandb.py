"""logging.wandb: a tiny run logs to Weights & Biases offline (WANDB_MODE=offline, no account, no network) the
same scalars as TensorBoard and metrics.jsonl, plus the config; its rerun resumes the same W&B run; asking
for W&B without the package installed is refused when the config is loaded."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llmtrain.config import ConfigError, load
from llmtrain.training.metrics_file import read_rows
from llmtrain.training.run import run
from tests.training._runs import CONFIG, TINY

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install wandb")

_BLOCK = 32768  # W&B's transaction log: LevelDB's log format, 32 KiB blocks, 7-byte record headers
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline run's run-<id>.wandb file.

    The file is a 7-byte header (":W&B", magic 0xBEE1, version) and then LevelDB log records (CRC-32C,
    length, type: full, first, middle, last), which never cross a 32 KiB block; a block's tail too short for
    a header is zero padding. wandb itself reads the file only in its Go core, so the test reads it here.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:
            pos += _BLOCK - pos % _BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # padding up to the block's end
            pos += _BLOCK - pos % _BLOCK
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The Records of an offline run's log once wandb has written its last one (the run's exit record).

    `wandb.finish()` can return before wandb-core's writer has flushed and closed the file (seen under load:
    the file then lacked the run record), so the test waits for the exit record that the writer puts last.
    """
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = wandb_records(path)
        except DecodeError:  # a record cut off mid-write
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def offline_run(folder: Path) -> dict:
    """One offline run directory's id, name, tags, config and history ({step: {key: value}})."""
    (log,) = folder.glob("run-*.wandb")
    out: dict = {"history": {}, "config": {}}
    for record in finished_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out |= {"id": record.run.run_id, "name": record.run.display_name, "tags": list(record.run.tags)}
            out["config"] |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "config":
            out["config"] |= {u.key: json.loads(u.value_json) for u in record.config.update}
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            ours = {k: v for k, v in row.items() if not k.startswith("_")}  # W&B adds _step, _runtime, ...
            out["history"].setdefault(row["_step"], {}).update(ours)
    return out


def tensorboard_scalars(out: Path) -> dict[int, dict[str, float]]:
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    table: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            table.setdefault(event.step, {})[tag] = event.value
    return table


@needs_wandb
@pytest.mark.slow
def test_offline_run_logs_tensorboard_scalars_and_config_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # W&B's console capture would fight pytest's
    out = tmp_path / "run"
    overrides = [
        *TINY,
        f"output_dir={out}",
        "logging.tensorboard=true",
        "logging.interval=1",
        "train.eval_interval=0",
        "checkpoint.interval=2",
        "logging.wandb.project=llmtrain-test",
        "logging.wandb.name=tiny",
        "logging.wandb.tags=[ci,tiny]",
    ]
    run(load(CONFIG, [*overrides, "train.steps=2"]))
    run_id = (out / "wandb" / "run_id").read_text().strip()
    (first,) = (out / "wandb").glob("offline-run-*")
    logged = offline_run(first)
    assert (logged["id"], logged["name"], logged["tags"]) == (run_id, "tiny", ["ci", "tiny"])
    assert logged["config"]["train"]["steps"] == 2 and logged["config"]["model"]["num_layers"] == 2
    # The same tags, steps and values as TensorBoard (float32 there, so compared at float32's precision).
    board = tensorboard_scalars(out)
    assert sorted(logged["history"]) == sorted(board) == [1, 2]
    for step, tags in board.items():
        assert set(logged["history"][step]) == set(tags)
        for tag, value in tags.items():
            assert logged["history"][step][tag] == pytest.approx(value, rel=1e-6), (step, tag)
    rows = {row["step"]: row for row in read_rows(out)}
    assert [logged["history"][s]["train/loss"] for s in (1, 2)] == [rows[s]["loss"] for s in (1, 2)]

    # A rerun with more steps resumes the same W&B run (same id) and logs only the new steps.
    run(load(CONFIG, [*overrides, "train.steps=4"]))
    assert (out / "wandb" / "run_id").read_text().strip() == run_id
    (second,) = set((out / "wandb").glob("offline-run-*")) - {first}
    resumed = offline_run(second)
    assert resumed["id"] == run_id and resumed["config"]["train"]["steps"] == 4
    assert sorted(resumed["history"]) == [3, 4]
    rows = {row["step"]: row for row in read_rows(out)}
    assert [resumed["history"][s]["train/loss"] for s in (3, 4)] == [rows[s]["loss"] for s in (3, 4)]
    capsys.readouterr()


def test_wandb_without_the_package_is_refused_when_the_config_loads(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        load(CONFIG, ["logging.wandb.project=p"])
    assert str(err.value) == (
        "logging.wandb.project=p needs the wandb package, which is not installed; run pip install "
        "'llmtrain[wandb]', or leave logging.wandb.project unset"
    )


def test_wandb_fields_without_a_project_are_refused():
    with pytest.raises(ConfigError, match=r"^logging.wandb.tags is set but logging.wandb.project is not"):
        load(CONFIG, ["logging.wandb.tags=[a]"])
    with pytest.raises(ConfigError, match=r"^logging.wandb.project is empty"):
        load(CONFIG, ["logging.wandb.project=''"])


def test_a_wandb_run_that_cannot_start_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    import sys
    import types

    from llmtrain.training.wandb_run import WandbError, WandbRun

    def refuse(**_):
        raise RuntimeError("api_key not configured (no-tty)")

    job = load(CONFIG, [f"output_dir={tmp_path / 'run'}", "logging.wandb.project=p"])
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=refuse))
    with pytest.raises(WandbError) as err:
        WandbRun.open(job)
    assert str(err.value) == (
        "logging.wandb.project=p: W&B could not start the run (RuntimeError: api_key not configured "
        "(no-tty)); run `wandb login`, or set WANDB_MODE=offline to log to "
        f"{tmp_path / 'run' / 'wandb'} and upload later with `wandb sync`"
    )
    assert not (tmp_path / "run" / "wandb" / "run_id").exists()
