"""Bad checkpoint inputs end in one line naming the path and the fix: in the library (CheckpointError, a
UserError) and through tools/convert_checkpoint.py run as a user runs it, in a subprocess, where stderr holds
no traceback unless --debug or LLMTRAIN_DEBUG=1 asks for one."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint import Checkpointer, CheckpointError
from llmtrain.checkpoint.convert import import_model, to_hf
from llmtrain.checkpoint.manager import read_meta, resolve, saved_model_config, verify
from llmtrain.cli import run_tool
from llmtrain.config import ModelConfig
from llmtrain.errors import UserError
from llmtrain.models import build, save_pretrained
from llmtrain.parallel import Topology
from tests.checkpoint._util import build as build_for_training
from tests.checkpoint._util import tiny_job
from tests.imports import run_listing_imports, third_party
from tests.models.hf_models import hf_model

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    hf_model("llama", 3).save_pretrained(tmp_path / "hf model")  # a space: suggested commands are quoted
    return tmp_path / "hf model"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    job = tiny_job(tmp_path / "run")
    model, opt = build_for_training(job, Topology.single())
    Checkpointer(job, Topology.single()).save(1, model, opt, {"step": 1})
    return tmp_path / "run"


def _message(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        resolve(path)
    assert isinstance(info.value, UserError)
    return str(info.value)


def test_resolve_names_what_the_path_is_and_what_to_give(tmp_path: Path, hf_dir: Path) -> None:
    expected = "give a step_<N> directory, a checkpoints/ directory or an output_dir that holds one"
    assert _message(tmp_path / "nowhere") == f"checkpoint {tmp_path / 'nowhere'} does not exist; {expected}"
    (tmp_path / "file.pt").write_bytes(b"")
    assert (
        _message(tmp_path / "file.pt")
        == f"{tmp_path / 'file.pt'} is a file, not a checkpoint directory; {expected}"
    )
    (tmp_path / "empty").mkdir()
    assert "is not a checkpoint (no manifest.json and no latest pointer); give a step_<N>" in _message(
        tmp_path / "empty"
    )
    torch.manual_seed(0)
    save_pretrained(
        build(ModelConfig(arch="gpt", num_layers=1, hidden_size=32, num_attention_heads=2)), tmp_path / "m"
    )
    assert _message(tmp_path / "m").startswith(
        f"{tmp_path / 'm'} is an llmtrain model directory, not a training"
    )


def test_hf_directory_as_checkpoint_names_a_conversion_that_works(hf_dir: Path) -> None:
    message = _message(hf_dir)
    assert message.startswith(
        f"{hf_dir} is a Hugging Face model directory, not a training checkpoint; convert"
    )
    command = re.search(r"convert it first: python (.*) \(your training layout\), then load (.*)$", message)
    assert command is not None, message
    args = shlex.split(command.group(1).replace(" N", " 1"))
    assert args[:2] == ["tools/convert_checkpoint.py", "hf-to-llmtrain"]
    # What the message says to run makes what it says to load.
    import_model(args[3], args[5], tp=int(args[7]), pp=int(args[9]))
    assert resolve(Path(shlex.split(command.group(2))[0])).name == "step_0"


def test_reverse_directions_are_named(checkpoint: Path, hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"is a training checkpoint, not a model directory; export it with"
    ):
        import_model(checkpoint, tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"is a training checkpoint.*llmtrain-to-hf --input"):
        import_model(checkpoint / "checkpoints" / "step_1", tmp_path / "out", tp=2)
    with pytest.raises(UserError, match="is a Hugging Face model directory already; to train from it"):
        to_hf(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_damaged_metadata_is_named(checkpoint: Path) -> None:
    step = checkpoint / "checkpoints" / "step_1"
    meta = json.loads((step / "meta.json").read_text())
    with pytest.raises(CheckpointError, match="records a model config this version does not know"):
        saved_model_config(step, {**meta, "model": {**meta["model"], "a_field_from_a_newer_version": 8}})
    (step / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta.json is missing or corrupt .*load an earlier step_<N>"):
        read_meta(step)
    (step / "manifest.json").write_text("[]")
    with pytest.raises(
        CheckpointError, match=r"manifest.json is unreadable or corrupt .*load an earlier step_<N>"
    ):
        verify(step)


def _tool(*args: str, debug_env: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMTRAIN_DEBUG", "RANK")}
    if debug_env:
        env["LLMTRAIN_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def _load_tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _tool_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple:
    """The tool's `run_tool(main)` as its __main__ runs it, in this interpreter: (exit code, stderr). An
    exception other than a user error escapes to the test (where a subprocess would print its traceback)."""
    monkeypatch.setattr(sys, "argv", [str(TOOL), *args])
    with pytest.raises(SystemExit) as exited:
        run_tool(_load_tool().main)
    return exited.value.code, capsys.readouterr().err


def _one_line(code: object, stderr: str, message: str) -> None:
    assert code == 2, (code, stderr)
    assert stderr.startswith("convert_checkpoint: error: ") and message in stderr, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr


@pytest.mark.slow
def test_tool_errors_are_one_line_without_traceback(
    checkpoint: Path, hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    step = checkpoint / "checkpoints" / "step_1"
    shard = step / "__0_0.distcp"
    corrupt = bytearray(shard.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    (tmp_path / "a file").write_text("")
    cases = [
        (["inspect", "--input", str(tmp_path / "nowhere")], "does not exist; give a step_<N> directory"),
        (["reshard", "--input", str(hf_dir), "--output", str(tmp_path / "o"), "--tp", "1", "--pp", "1"],
         "is a Hugging Face model directory, not a training checkpoint; convert it first"),
        (["hf-to-llmtrain", "--input", str(checkpoint), "--output", str(tmp_path / "o")],
         "is a training checkpoint, not a model directory; export it with python tools/convert_checkpoint.py "
         "llmtrain-to-hf"),
        (["llmtrain-to-hf", "--input", str(checkpoint), "--output", str(tmp_path / "a file" / "hf")],
         "a file is a file, not a directory; choose another path"),
        (["llmtrain-to-hf", "--input", str(checkpoint), "--output", str(tmp_path / "o")],
         "__0_0.distcp is corrupt"),
    ]  # fmt: skip
    # Each case through the tool's own main and run_tool in this process (a tool subprocess costs seconds of
    # imports each): the exit code, the one line and its text are what a user sees. The last case (the
    # deepest: it loads and verifies the shard) also runs as a real subprocess, end to end: no traceback
    # reaches stderr from anywhere in the tool, its imports included.
    for args, message in cases:
        if "corrupt" in message:
            shard.write_bytes(bytes(corrupt))
        monkeypatch.delenv("LLMTRAIN_DEBUG", raising=False)
        monkeypatch.delenv("RANK", raising=False)
        _one_line(*_tool_here(monkeypatch, capsys, *args), message)
        assert not (tmp_path / "o").exists()
    result = _tool(*cases[-1][0])
    _one_line(result.returncode, result.stderr, cases[-1][1])
    assert not (tmp_path / "o").exists()
    # Asked for, the traceback is shown: by --debug (in this process, the error escapes run_tool, which a
    # subprocess prints as a traceback with exit code 1) and by LLMTRAIN_DEBUG=1 (a real subprocess).
    monkeypatch.setattr(sys, "argv", [str(TOOL), "inspect", "--input", str(tmp_path / "nowhere"), "--debug"])
    with pytest.raises(CheckpointError, match="checkpoint .* does not exist"):
        run_tool(_load_tool().main)
    result = _tool("inspect", "--input", str(tmp_path / "nowhere"), debug_env=True)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "CheckpointError: checkpoint" in result.stderr and "does not exist" in result.stderr


def test_help_answers_at_once_without_importing_torch() -> None:
    for args in ([], ["llmtrain-to-hf"], ["inspect"]):
        result, imported = run_listing_imports([str(TOOL), *args, "--help"], ROOT)
        assert result.returncode == 0 and "usage: convert_checkpoint.py" in result.stdout
        assert "torch" not in imported and "llmtrain.checkpoint" not in imported
        # Only the standard library and llmtrain's light modules: no numpy, safetensors or yaml to wait for.
        assert not third_party(imported), f"--help imported {sorted(third_party(imported))}"


def test_conversion_never_replaces_an_existing_output_without_overwrite(
    checkpoint: Path, tmp_path: Path
) -> None:
    """An earlier export may have been edited or shipped since: a rerun must not silently replace it."""
    tool = _load_tool()
    out = tmp_path / "hf"
    assert tool.main(["llmtrain-to-hf", "--input", str(checkpoint), "--output", str(out)]) == 0
    (out / "README.md").write_text("my model card")
    for command in (
        ["llmtrain-to-hf", "--input", str(checkpoint), "--output", str(out)],
        ["hf-to-llmtrain", "--input", str(out), "--output", str(out)],
        ["reshard", "--input", str(checkpoint), "--output", str(out), "--tp", "1", "--pp", "1"],
    ):
        with pytest.raises(CheckpointError, match=r"already exists and is not empty; .* pass --overwrite"):
            tool.main(command)
        assert (out / "README.md").read_text() == "my model card"
    assert tool.main(["llmtrain-to-hf", "--input", str(checkpoint), "--output", str(out), "--overwrite"]) == 0
    assert not (out / "README.md").exists() and (out / "config.json").is_file()
