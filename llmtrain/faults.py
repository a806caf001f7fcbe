"""Fault injection for the fault-tolerance tests: off unless the LLMTRAIN_FAULTS variable names faults.

Set in the environment rather than the config so a fault can never be saved into a run's config and
injected again when the run resumes. The variable holds faults separated by commas, each a name and
`key=value` parameters separated by colons, e.g. `LLMTRAIN_FAULTS=nan_loss:step=3:rank=1,hang:rank=2`.
A parameter whose key the injection point passes in `where` must match it for the fault to fire; the
others are settings the injection point reads from `Fault.params`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV = "LLMTRAIN_FAULTS"


@dataclass(frozen=True)
class Fault:
    """One fault to inject: where it fires (parameters matched against the injection point) and how."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def matches(self, where: dict[str, object]) -> bool:
        return all(str(where[key]) == value for key, value in self.params.items() if key in where)


def parse(text: str) -> list[Fault]:
    """The faults that `text` (the variable's value) names; a malformed entry is a ValueError naming it."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, *settings = entry.split(":")
        params = {}
        for setting in settings:
            key, sep, value = setting.partition("=")
            if not sep or not key:
                raise ValueError(f"{ENV}: {entry!r} has {setting!r}; write parameters as key=value")
            params[key] = value
        faults.append(Fault(name, params))
    return faults


def injected(name: str, **where: object) -> Fault | None:
    """The fault called `name` that matches this injection point, or None (always None when unset)."""
    text = os.environ.get(ENV, "")
    if not text:
        return None
    return next((f for f in parse(text) if f.name == name and f.matches(where)), None)
