"""Timeline pictures and traces: the drawn data round-trips and agrees with the simulator it came from."""

from __future__ import annotations

import json

import pytest

from llmtrain.pipeline.schedules import build_schedule
from llmtrain.pipeline.simulator import simulate
from llmtrain.pipeline.timeline import (
    Span,
    bubble_fraction,
    chrome_trace,
    load_trace,
    save_trace,
    spans_from_simulation,
)
from tools.show_schedule import main


def test_measured_bubble_of_simulated_spans_equals_the_simulators():
    for args in [("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("zb_h1", 3, 5, 1)]:
        sim = simulate(build_schedule(*args), 1.0, 2.0, p2p=0.1)
        assert bubble_fraction(spans_from_simulation(sim)) == pytest.approx(sim.bubble_fraction)


def test_trace_round_trip_and_chrome_trace(tmp_path):
    sim = simulate(build_schedule("interleaved_1f1b", 2, 4, 2), 0.5, 1.0)
    spans = spans_from_simulation(sim)
    save_trace(spans, tmp_path / "t.json")
    assert load_trace(tmp_path / "t.json") == spans
    chrome_trace(spans, tmp_path / "c.json", microseconds_per_unit=1000)
    events = [e for e in json.loads((tmp_path / "c.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * 4 * 2 * 2  # ranks * micro-batches * chunks * (F, B)
    last = max(events, key=lambda e: e["ts"] + e["dur"])
    assert last["ts"] + last["dur"] == pytest.approx(sim.step_time * 1000)
    assert {e["tid"] for e in events} == {0, 1}


def test_bad_trace_names_the_missing_field(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"rank": 0, "kind": "F", "start": 0, "end": 1}]))
    with pytest.raises(ValueError, match="microbatch"):
        load_trace(tmp_path / "bad.json")


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
def test_tool_draws_simulated_and_traced_runs(tmp_path, capsys):
    png = tmp_path / "zb.png"
    main(["--schedule", "zb_h1", "--pp", "4", "--microbatches", "8", "--output", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble fraction 0.1250" in capsys.readouterr().out
    # A "traced" run: two ranks, one idle unit each around 4 busy units -> bubble (2*5 - 8) / 8.
    spans = [Span(0, "F", 0, 0, 0.0, 1.0), Span(0, "B", 0, 0, 2.0, 5.0), Span(1, "F", 0, 0, 1.0, 2.0)]
    spans.append(Span(1, "B", 0, 0, 2.0, 5.0))
    save_trace(spans, tmp_path / "run.json")
    main(
        ["--schedule", "1f1b", "--pp", "2", "--microbatches", "1", "--trace", str(tmp_path / "run.json")]
        + ["--output", str(tmp_path / "run.png"), "--chrome-trace", str(tmp_path / "run_chrome.json")]
    )
    assert "bubble fraction 0.2500" in capsys.readouterr().out
    assert (tmp_path / "run.png").stat().st_size > 1000
    assert json.loads((tmp_path / "run_chrome.json").read_text())["traceEvents"]
