"""The generated configuration reference: current, complete, and faithful to the dataclasses."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmtrain.config.reference import field_docs, generate, missing_docs, sections

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "configuration.md"


def gen_main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("gen_tool", ROOT / "tools" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_checked_in_reference_is_current():
    assert DOCS.read_text() == generate(), "stale: run python tools/gen_config_reference.py"


def test_every_field_has_a_one_line_docstring():
    assert missing_docs() == []


@dataclass
class _Sample:
    """A sample."""

    documented: int = 1
    """One line."""
    undocumented: str = "x"
    multi: float = 2.0
    """First line.

    Second paragraph."""


def test_field_docs_reads_attribute_docstrings_only_where_present():
    assert field_docs(_Sample) == {"documented": "One line.", "multi": "First line.\n\nSecond paragraph."}


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_field_appears_with_its_default_as_yaml():
    rows = _table_rows(generate())
    count = 0
    for prefix, cls in sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            row = rows[key]
            count += 1
            if dataclasses.is_dataclass(hints[f.name]):
                assert row[1].startswith("[section](#")
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert yaml.safe_load(row[2].strip("`")) == default, key  # YAML reads back the dataclass default
    assert count == len(rows) == sum(len(dataclasses.fields(cls)) for _, cls in sections())


def test_check_mode_fails_on_a_stale_file_and_passes_after_writing(tmp_path, capsys):
    target = tmp_path / "configuration.md"
    assert gen_main(["--check", "--output", str(target)]) == 1  # missing
    target.write_text("old\n")
    assert gen_main(["--check", "--output", str(target)]) == 1
    assert "stale" in capsys.readouterr().err
    assert gen_main(["--output", str(target)]) == 0
    assert gen_main(["--check", "--output", str(target)]) == 0
