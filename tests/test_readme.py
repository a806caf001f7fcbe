"""The README's two quickstart commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_quickstart_commands():
    commands = _quickstart_commands()
    assert len(commands) == 2
    assert "tools/pretrain.py --config configs/ernie.yaml" in commands[0]
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]


def test_ci_runs_the_readme_test_command():
    test_command = _quickstart_commands()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
