"""The fault-injection switch: off by default, fires only where every matched parameter agrees."""

from __future__ import annotations

import pytest

from llmtrain.faults import ENV, Fault, injected, parse


def test_nothing_is_injected_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert injected("nan_loss", step=3, rank=0) is None


def test_a_fault_fires_only_where_its_matched_parameters_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "nan_loss:step=3:rank=1, spike:factor=50")
    assert injected("nan_loss", step=3, rank=1) == Fault("nan_loss", {"step": "3", "rank": "1"})
    assert injected("nan_loss", step=3, rank=0) is None
    assert injected("nan_loss", step=4, rank=1) is None
    spike = injected("spike", step=7)
    assert spike is not None and spike.params["factor"] == "50"
    assert injected("hang", step=3) is None


def test_a_malformed_entry_is_named() -> None:
    with pytest.raises(ValueError, match="'nan_loss:step3'"):
        parse("nan_loss:step3")
