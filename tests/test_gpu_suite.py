"""benchmarks/gpu (run_all.sh's steps) on CPU: the report's tables and verdicts, an end-to-end variant."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.kernels.test_attention" name="test_a"/>
<testcase classname="tests.kernels.test_attention" name="test_b"><failure message="x"/></testcase>
<testcase classname="tests.kernels.test_norms" name="test_c"><skipped message="y"/></testcase>
</testsuite></testsuites>"""


def test_report_gathers_every_step(tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text(
        "kernels\t124\t140\t140\tpython bench_kernels_peers.py --out k.json\n"
    )
    (tmp_path / "tests-kernels.xml").write_text(JUNIT)
    kernel_row = {"kernel": "rms_norm", "impl": "triton", "status": "ok", "fwd_ms": 0.1, "fwd_bwd_ms": 0.3}
    kernel_row |= {
        "peak_mib": 64.0,
        "time_vs_triton": 1.0,
        "fwd_bwd_gbps": 2900.0,
        "fraction_of_bandwidth": 0.9,
        "fwd_fraction_of_bandwidth": 0.8,
        "timing": "cuda graph",
        "eager_fwd_bwd_ms": 0.5,
    }
    fallback_row = kernel_row | {"impl": "liger", "timing": "eager launches"}
    fallback_row["timing_note"] = "cuda graph failed: RuntimeError: capture | sync"
    kernels = {"shape": {"tokens": 8192}, "dtype": "torch.bfloat16", "copy_bandwidth_gbps": 3000.0}
    kernels |= {"peers": {"liger_kernel": "not installed"}, "targets": {}, "rows": [kernel_row, fallback_row]}
    e2e_row = {"config": "llama-1b.yaml", "overrides": ["train.precision=fp8"], "compile": "blocks"}
    e2e_row |= {"tokens_per_s": 30000.0, "tflops": 400.0, "mfu_vs_bf16_peak": 0.404, "status": "ok"}
    e2e = {"rows": [e2e_row], "torchtitan": "not installed", "targets": {}}
    curves = {"worst_relative_gap_to_fp32": {"bf16": 0.01, "fp8": 0.2}, "bounds": {"bf16": 0.05, "fp8": 0.08}}
    curves |= {
        "within_bound": {"bf16": True, "fp8": False, "fp8_vs_bf16": True},
        "curves": {"fp32": [3.0, 2.0], "bf16": [3.0, 2.01]},
        "worst_relative_gap_fp8_to_bf16": 0.02,
        "bound_fp8_to_bf16": 2**-5,
    }
    for name, payload in (("kernels", kernels), ("e2e", e2e), ("loss_curves", curves)):
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))
    subprocess.run([sys.executable, str(GPU / "report.py"), str(tmp_path)], check=True, capture_output=True)
    md = (tmp_path / "README.md").read_text()
    assert "passed 1, failed 1, errors 0, skipped 1" in md
    assert "- FAILED tests.kernels.test_attention::test_b" in md
    assert "| kernels | 124 | 140 | 140 |" in md  # a step stopped at its budget shows exit 124
    row = "| rms_norm | triton | 0.1 | 0.3 | 2900 | 90% (fwd 80%) | 64 | 1.00 | cuda graph | 0.5 | ok |"
    assert row in md
    assert "| eager launches (cuda graph failed: RuntimeError: capture / sync) | 0.5 | ok |" in md
    assert "| llama-1b.yaml | train.precision=fp8 | blocks | 30000 | 400.0 | 40.4% |" in md
    assert "fp8: worst per-step relative gap 0.2000, OUTSIDE the bound 0.0800" in md
    assert "fp8 against bf16: worst per-step relative gap 0.0200, within the bound 0.0312" in md
    assert "no env.json" not in md and json.loads((tmp_path / "results.json").read_text())["env"] is None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One dry run of bench_e2e.py for bf16 and fp8, its main called in this process (each variant still
    runs in a child process of its own, as on the GPU): our bf16 row, torchtitan's after it, our fp8 row.
    The tests below read the same JSON; a run per precision started the script and its imports twice
    (~5 CPU-s each) for the same rows."""
    sys.path.insert(0, str(GPU))
    import bench_e2e

    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    args = ["--dry-run", "--configs", str(ROOT / "configs/llama-1b.yaml"), "--precision", "bf16", "fp8"]
    assert bench_e2e.main([*args, "--compile", "none", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_e2e_dry_run_trains_an_fp8_variant(dry_run: dict) -> None:
    ours = [r for r in dry_run["rows"] if r["impl"] == "llmtrain"]
    assert [r["overrides"][-1] for r in ours] == ["train.precision=bf16", "train.precision=fp8"]
    row = ours[1]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["mfu_vs_bf16_peak"] is None  # no peak to stand behind on CPU
    assert len(row["losses"]) == 3 and all(loss > 0 for loss in row["losses"])


def _e2e_row(config: str, precision: str, compile_mode: str, impl: str | None, tokens_per_s, status="ok"):
    row = {"config": config, "overrides": [f"train.precision={precision}"], "compile": compile_mode}
    row |= {"status": status} | ({"impl": impl} if impl else {})
    return row | ({"tokens_per_s": tokens_per_s} if tokens_per_s is not None else {})


def test_vs_torchtitan_takes_our_best_bf16_row_over_torchtitans() -> None:
    sys.path.insert(0, str(GPU))
    from report import vs_torchtitan

    titan = "torchtitan 0.2.2 model + its AC/compile/AMP, our loop"
    rows = [
        _e2e_row("llama-1b.yaml", "bf16", "none", "llmtrain", 42000.0),
        _e2e_row("llama-1b.yaml", "bf16", "blocks", "llmtrain", 44000.0),
        _e2e_row("llama-1b.yaml", "fp8", "blocks", "llmtrain", 90000.0),  # not bf16: not compared
        _e2e_row("llama-1b.yaml", "bf16", "blocks", None, 99000.0, status="failed: OOM"),  # not ok
        _e2e_row("llama-1b.yaml", "bf16", "blocks", titan, 40000.0),
        _e2e_row("llama-3b.yaml", "bf16", "none", "llmtrain", 15000.0),
        _e2e_row("llama-3b.yaml", "bf16", "blocks", titan, None, status="failed: ImportError: x"),
        _e2e_row("llama-8b.yaml", "bf16", "none", "llmtrain", 5000.0),  # no torchtitan row: absent
    ]
    ratios = vs_torchtitan(rows)
    assert set(ratios) == {"llama-1b.yaml", "llama-3b.yaml"}
    one = ratios["llama-1b.yaml"]
    assert one["ratio"] == pytest.approx(1.1) and one["ours_tokens_per_s"] == 44000.0
    assert one["ours_variant"] == "train.precision=bf16 compile=blocks" and "why" not in one
    three = ratios["llama-3b.yaml"]
    assert three["ratio"] is None and three["torchtitan_tokens_per_s"] is None
    assert three["why"] == "torchtitan: failed: ImportError: x"


def test_report_prints_the_torchtitan_ratio(tmp_path: Path) -> None:
    titan = "torchtitan 0.2.2 model + its AC/compile/AMP, our loop"
    rows = [
        _e2e_row("llama-1b.yaml", "bf16", "none", "llmtrain", 42000.0),
        _e2e_row("llama-1b.yaml", "bf16", "blocks", titan, 40000.0),
        _e2e_row("llama-3b.yaml", "bf16", "none", "llmtrain", 15000.0),
        _e2e_row("llama-3b.yaml", "bf16", "blocks", "torchtitan", None, status="not installed"),
    ]
    (tmp_path / "e2e.json").write_text(json.dumps({"rows": rows, "torchtitan": "0.2.2", "targets": {}}))
    subprocess.run([sys.executable, str(GPU / "report.py"), str(tmp_path)], check=True, capture_output=True)
    md = (tmp_path / "README.md").read_text()
    ratio = "- llama-1b.yaml: llmtrain / torchtitan tokens/s = 1.05 (42000 / 40000; target >= 1.1: **missed**"
    assert ratio in md
    assert "- llama-3b.yaml: llmtrain / torchtitan tokens/s = - (15000 / -; target >= 1.1: -" in md
    assert "torchtitan: not installed)" in md
    assert f"| 40000 | - | - | - | {titan} | ok |" in md


def test_titan_peer_ffn_rule_gives_the_configs_width() -> None:
    sys.path.insert(0, str(GPU))
    from titan_peer import ffn_rule

    # torchtitan's rule: multiple_of * ceil(int(multiplier * int(8 * hidden / 3)) / multiple_of)
    def width(hidden: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
        base = int(2 * (4 * hidden) / 3)
        base = int(ffn_dim_multiplier * base) if ffn_dim_multiplier is not None else base
        return multiple_of * ((base + multiple_of - 1) // multiple_of)

    for hidden, ffn in ((2048, 8192), (3072, 8192), (64, 128), (4096, 14336)):
        rule = ffn_rule(hidden, ffn)
        assert width(hidden, **rule) == ffn
    assert ffn_rule(2048, 8192) == {"multiple_of": 8192, "ffn_dim_multiplier": None}


@pytest.mark.slow
def test_e2e_dry_run_reports_torchtitan_not_installed(dry_run: dict) -> None:
    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed here: its row runs instead")
    ours, titan, _ = dry_run["rows"]
    assert ours["status"] == "ok" and ours["impl"] == "llmtrain"
    assert ours["overrides"][-1] == "train.precision=bf16"
    assert titan["impl"] == "torchtitan" and titan["status"] == "not installed"
    assert dry_run["torchtitan"] == "not installed"
    assert dry_run["vs_torchtitan"]["llama-1b.yaml"]["why"] == "torchtitan: not installed"
