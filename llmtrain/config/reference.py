"""The configuration reference (docs/configuration.md), generated from the config dataclasses.

Each field's description is the attribute docstring right below it in schema.py, read with `ast`
(Python keeps no runtime record of attribute docstrings); type and default come from the dataclass.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, Literal, Union

import yaml

from llmtrain.config.schema import JobConfig

HEADER = """# Configuration reference

Generated from the field docstrings in `llmtrain/config/schema.py` by
`python tools/gen_config_reference.py`; do not edit by hand (CI runs it with `--check`).

Every field can be set in the YAML config under its section, or on the command line as
`section.field=value` after the config file, e.g.
`python tools/pretrain.py --config configs/gpt-small.yaml train.steps=20 parallel.tp=2`
(values are read as YAML: numbers, `true`/`false`, `null`, lists like `[10,12]`).
"""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field name: docstring} for fields that have one."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def sections(prefix: str = "", cls: type = JobConfig) -> list[tuple[str, type]]:
    """(key prefix, dataclass) pairs: the top level, then each nested section in field order, a section
    nested in a section (logging.wandb) right after its parent."""
    hints = typing.get_type_hints(cls)
    out = [(prefix, cls)]
    for name, hint in hints.items():
        if dataclasses.is_dataclass(hint):
            out += sections(f"{prefix}.{name}" if prefix else name, hint)
    return out


def anchor(prefix: str, cls: type) -> str:
    """GitHub's anchor of the heading "## `logging.wandb` (WandbConfig)": "loggingwandb-wandbconfig"."""
    return f"{prefix.replace('.', '')}-{cls.__name__.lower()}"


def format_type(hint: Any) -> str:
    """A type hint in the words of a YAML author: 'int or null', 'one of gpt, llama, ernie'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        options = [format_type(a) for a in args if a is not type(None)]
        return " or ".join(options + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"list of {format_type(args[0])}"
    if dataclasses.is_dataclass(hint):
        return "section"  # generate() links it to the section's heading
    return getattr(hint, "__name__", str(hint))


def format_default(f: dataclasses.Field) -> str:
    """The default as YAML text."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return ""
    else:
        value = f.default
    # YAML's own spelling, so the text pastes back into a config file as the same value (1.0e-05, null).
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _escape(text: str) -> str:
    """Table-cell text that renders as written: | ends a cell, * emphasises, <x> is an HTML tag."""
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return text


def generate() -> str:
    """The whole reference as Markdown."""
    out = [HEADER]
    for prefix, cls in sections():
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        title = f"`{prefix}` ({cls.__name__})" if prefix else f"Top level ({cls.__name__})"
        out += [f"## {title}", "", inspect.getdoc(cls) or "", ""]
        out += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            default = format_default(f)
            kind = _escape(format_type(hints[f.name]))
            if kind == "section":
                kind = f"[section](#{anchor(key, hints[f.name])})"
            cells = [
                f"`{key}`",
                kind,
                "`" + default.replace("|", "\\|") + "`" if default else "",  # code span: only | is special
                _escape(docs.get(f.name, "")),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def missing_docs() -> list[str]:
    """Fields (and sections) without a one-line docstring, as 'key: problem' lines."""
    problems = []
    for prefix, cls in sections():
        if not inspect.getdoc(cls):
            problems.append(f"{cls.__name__}: no class docstring")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            doc = docs.get(f.name, "")
            if not doc.strip():
                problems.append(f"{key}: no docstring below the field in llmtrain/config/schema.py")
            elif "\n" in doc:
                problems.append(f"{key}: docstring spans several lines; keep it to one")
    return problems
