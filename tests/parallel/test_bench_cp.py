"""benchmarks/bench_cp.py: activation memory per rank falls as 1/cp in the trainer's own memory records, and
the speed/overlap section runs end to end (timings are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cp.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cp", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_activation_memory_per_rank_falls_as_one_over_cp():
    """llama-small, 4 layers, one sequence of 1024 tokens, trained by tools/pretrain.py at cp = 1, 2, 4:
    static bytes (parameters, gradients, Adam: 16 per parameter) are the same on every rank at every cp,
    and the rest, the activations, is each rank's share of per-token tensors: exactly activations(1) / cp
    of them, so never less, plus what ring attention alone holds, bounded by bench_cp.ring_extra_bytes
    (one chunk pair's fp32 score-sized temporaries, the K/V and dK/dV in flight). The live-tensor tracker
    counts exact bytes, so no other slack is needed."""
    bench = _bench()
    rows = bench.memory_table(seq=1024, layers=4, cps=[1, 2, 4], steps=2)
    base = rows[0]["activations"]
    assert base > rows[0]["static"] / 2, "activations must dominate enough for the ratio to mean anything"
    for row in rows:
        assert len(set(row["rank_peaks_mib"])) == 1, f"cp={row['cp']}: ranks differ {row['rank_peaks_mib']}"
        share = base / row["cp"]
        assert share <= row["activations"] <= share + row["ring_extra"], (
            f"cp={row['cp']}: activations {row['activations']} bytes, expected {share:.0f} + at most "
            f"{row['ring_extra']}"
        )


def test_waits_split_into_skew_and_exposed_transfer():
    """split_waits on hand-made timelines of a 2-rank ring (posted, first waited, wait returned): a wait
    before the neighbour posts is skew, the rest exposed transfer; a transfer done before the wait hides."""
    bench = _bench()
    # Exchange 0: rank 1 posts at 5 while rank 0 waits from 2 to 6: 3 s skew, then 1 s exposed; rank 1
    # waits from 7 to 7.5 with rank 0 posted long before: 0.5 s exposed. Exchange 1: both posted at 10 and
    # computed until 12, the transfer was done by then: their waits return at once.
    timelines = [
        [(0.0, 2.0, 6.0), (10.0, 12.0, 12.0)],
        [(5.0, 7.0, 7.5), (10.0, 12.0, 12.0)],
    ]
    skew, exposed = bench.split_waits(timelines)
    assert skew == [3.0, 0.0]
    assert exposed == [1.0, 0.5]
    # A ring of 3: rank 0's neighbours are ranks 2 and 1; the later of their posts (4) ends the skew.
    skew, exposed = bench.split_waits([[(0.0, 1.0, 5.0)], [(4.0, 4.0, 5.0)], [(2.0, 3.0, 5.0)]])
    assert skew == [3.0, 0.0, 1.0]
    assert exposed == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_speed_section_reports_every_cp(tmp_path, capsys, monkeypatch):
    """Through the script's main() in this process (its ranks are spawned processes either way): a
    subprocess would start Python, torch and llmtrain once more for nothing the test checks."""
    out = tmp_path / "cp.json"
    args = [
        "--skip-memory",
        "--seq",
        "64",
        "--layers",
        "1",
        "--cps",
        "2",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks' (each also sets one torch thread)
    _bench().main(args)
    assert "overlap" in capsys.readouterr().out
    tables = json.loads(out.read_text())
    (blocks,) = tables["blocks"]
    assert blocks["cp"] == 2 and all(blocks[k]["median"] > 0 for k in ("sdpa", "fused", "explicit"))
    (row,) = tables["speed"]
    assert row["cp"] == 2 and 0.0 <= row["overlap"] <= 1.0
    assert row["with"] > 0 and row["without"] > 0 and row["comm"] > 0
    # Every wait is split into skew and exposed transfer, nothing lost or counted twice (per rank; the
    # figures are the slowest rank's, so the sum of the two maxima is at least the largest wait).
    assert row["skew"] + row["exposed"] >= row["waited"] - 1e-9
    for key, (low, high) in row["spread"].items():
        assert low <= row[key] <= high, key
    assert row["exposed_home"] <= row["exposed"] + 1e-9 and 0.0 <= row["overlap_hideable"] <= 1.0
    # The dK/dV sent home are 1 of the 4 equal transfers per layer at cp = 2 (see below).
    assert row["home_bytes"] * 4 == row["bytes"]
    # The replayed transfers are the ring's of one step: a K/V block is (2, batch 1, 4 kv heads, 64 / cp
    # tokens, head 32) fp32 = 32 KiB; at cp = 2 it travels once forward and once backward, then its dK/dV
    # (the same size) moves on once and goes home once.
    assert row["bytes"] == 4 * 2 * 4 * 32 * 32 * 4
