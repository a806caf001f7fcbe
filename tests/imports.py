"""What a command imports beyond the interpreter's own start-up: how tests say "answers at once".

A bound on wall-clock or CPU seconds fails at random on a loaded 2-core machine; what makes a command like
`--help` slow is importing third-party packages (torch takes seconds, numpy a tenth), which does not depend
on load. Python's -X importtime lists every module a process imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _imported(arguments: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *arguments], capture_output=True, text=True, cwd=cwd, timeout=60
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return done, {line.split("|")[-1].strip() for line in lines[1:]}  # the first line is the header


def run_listing_imports(command: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime *command` and the modules it imported that interpreter start-up does not."""
    _, start_up = _imported(["-c", "pass"], cwd)
    done, imported = _imported(command, cwd)
    return done, imported - start_up


def third_party(modules: set[str]) -> set[str]:
    """The top-level packages among `modules` that are neither the standard library nor llmtrain."""
    tops = {module.split(".")[0] for module in modules}
    return {top for top in tops if top not in sys.stdlib_module_names and top != "llmtrain"}
