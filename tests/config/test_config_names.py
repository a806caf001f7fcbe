"""--config takes a path or the name of a shipped config (configs/), from any working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.config import ConfigError, load
from llmtrain.config.loader import SHIPPED_CONFIGS, resolve_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_bare_name_resolves_to_the_shipped_config_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config("ernie.yaml") == SHIPPED_CONFIGS / "ernie.yaml"
    assert resolve_config("ernie") == SHIPPED_CONFIGS / "ernie.yaml"
    assert load("ernie.yaml").model == load(ROOT / "configs" / "ernie.yaml").model


def test_a_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ernie.yaml").write_text("model:\n  num_layers: 3\n")
    assert load("ernie.yaml").model.num_layers == 3


def test_an_unknown_name_lists_the_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"nope.yaml does not exist.*shipped config by name \(.*ernie, "):
        load("nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load("some/dir/ernie.yaml")  # a path is never taken for a name


@pytest.mark.parametrize("tool", ["pretrain.py", "plan.py", "sweep.py"])
def test_tools_refuse_an_unknown_name_in_one_line(tool, tmp_path):
    """Exit code 2, one line naming the shipped configs, nothing written."""
    extra = {"plan.py": ["--gpus", "8"], "sweep.py": ["--grid", "train.lr=1e-3", "--output", "s"]}.get(
        tool, []
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), "--config", "nope.yaml", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "nope.yaml does not exist" in proc.stderr and "llama-1b" in proc.stderr
    assert list(tmp_path.iterdir()) == []
