"""Gather a results folder of run_all.sh into results.json and README.md (Markdown tables).

Reads env.json, steps.tsv (each step's command, exit status, seconds and budget), tests-*.xml (pytest's
JUnit reports), kernels.json, e2e.json and loss_curves.json; a missing file is reported as such.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _steps(folder: Path) -> list[dict[str, str]]:
    path = folder / "steps.tsv"
    if not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [dict(zip(("step", "rc", "seconds", "budget_s", "command"), r, strict=False)) for r in rows]


def _tests(folder: Path) -> dict[str, Any] | None:
    reports = sorted(folder.glob("tests-*.xml"))
    if not reports:
        return None
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    cases = [case for path in reports for case in ET.parse(path).getroot().iter("testcase")]
    for case in cases:
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        key = {"failure": "failed", "error": "errors"}.get(outcome, outcome)
        totals[key] += 1
        if key in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return {"totals": totals, "failures": failures}


def _fmt(value: Any, spec: str = ".3g") -> str:
    return format(value, spec) if isinstance(value, int | float) else ("-" if value is None else str(value))


def vs_torchtitan(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config: our best bf16 tokens/s over torchtitan's (the issue's side-by-side, target >= 1.1).

    Our rows are those with impl "llmtrain" (or none: results from before the peer was wired in) and
    train.precision=bf16 that finished ok; torchtitan's are those whose impl starts with "torchtitan".
    A config without an ok row on either side has a null ratio and says why.
    """
    out: dict[str, dict[str, Any]] = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        ours = [
            r
            for r in mine
            if r.get("impl", "llmtrain") == "llmtrain"
            and r["status"] == "ok"
            and "train.precision=bf16" in r["overrides"]
        ]
        titan = [r for r in mine if str(r.get("impl", "")).startswith("torchtitan")]
        if not titan:
            continue
        best = max(ours, key=lambda r: r["tokens_per_s"], default=None)
        peer = max((r for r in titan if r["status"] == "ok"), key=lambda r: r["tokens_per_s"], default=None)
        entry: dict[str, Any] = {
            "ours_tokens_per_s": best["tokens_per_s"] if best else None,
            "ours_variant": f"{' '.join(best['overrides'])} compile={best['compile']}" if best else None,
            "torchtitan_tokens_per_s": peer["tokens_per_s"] if peer else None,
            "ratio": best["tokens_per_s"] / peer["tokens_per_s"] if best and peer else None,
        }
        if not peer:
            entry["why"] = f"torchtitan: {titan[0]['status']}"
        elif not best:
            entry["why"] = "no ok bf16 llmtrain row"
        out[config] = entry
    return out


def markdown(results: dict[str, Any]) -> str:
    env, lines = results.get("env") or {}, []
    lines += [f"# GPU run: {env.get('device', 'unknown device')}", ""]
    if env.get("dry_run"):
        lines += ["**CPU dry run** (tiny shapes, TRITON_INTERPRET=1): the figures are not measurements.", ""]
    lines += ["## Environment", "", "| item | value |", "|---|---|"]
    for key, value in {**env.get("versions", {}), **env.get("nvidia_smi", {})}.items():
        lines.append(f"| {key} | {value} |")
    lines += [f"| git commit | {env.get('git_commit', '-')} |", "", "## Steps", ""]
    lines += ["| step | exit | seconds | budget | command |", "|---|---|---|---|---|"]
    for s in results["steps"]:
        lines.append(
            f"| {s['step']} | {s['rc']} | {s['seconds']} | {s['budget_s']} | `{s.get('command', '')}` |"
        )
    tests = results.get("tests")
    lines += ["", "## Tests (compiled kernels, models, training)", ""]
    if tests:
        lines.append(", ".join(f"{k} {v}" for k, v in tests["totals"].items()))
        lines += [f"- FAILED {f}" for f in tests["failures"]]
    else:
        lines.append("no tests-*.xml (the test steps did not finish)")
    kern = results.get("kernels")
    lines += ["", "## Kernels against peers", ""]
    if kern:
        lines.append(
            f"shape {kern['shape']}, {kern['dtype']}, copy bandwidth {kern['copy_bandwidth_gbps']:.0f} GB/s"
        )
        lines.append(f"peers: {kern['peers']}; targets: {kern['targets']}")
        lines += [
            "",
            "| kernel | impl | fwd ms | fwd+bwd ms | rate | of copy bw | peak MiB | t/triton | timing "
            "| eager fwd+bwd ms | status |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in kern["rows"]:
            rate = r.get("fwd_bwd_tflops")
            rate = (
                f"{rate:.1f} TFLOP/s (fwd {r['fwd_tflops']:.1f})"
                if rate
                else _fmt(r.get("fwd_bwd_gbps"), ".0f")
            )
            cells = [r["kernel"], r["impl"], _fmt(r.get("fwd_ms")), _fmt(r.get("fwd_bwd_ms")), rate]
            frac = _fmt(r.get("fraction_of_bandwidth"), ".0%") if r.get("fraction_of_bandwidth") else "-"
            if r.get("fwd_fraction_of_bandwidth"):
                frac += f" (fwd {r['fwd_fraction_of_bandwidth']:.0%})"
            cells += [frac]
            cells += [_fmt(r.get("peak_mib"), ".0f"), _fmt(r.get("time_vs_triton"), ".2f")]
            # How the times were taken: "cuda graph" (GPU time), "eager launches" (graph capture failed,
            # the note says why) or "wall clock" (CPU); the eager column keeps the launch overhead in.
            timing = _fmt(r.get("timing"))
            if r.get("timing_note"):
                timing += " (" + r["timing_note"][:80].replace("|", "/") + ")"
            cells += [timing, _fmt(r.get("eager_fwd_bwd_ms")), r["status"]]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        lines.append("no kernels.json")
    e2e = results.get("e2e")
    lines += ["", "## End to end", ""]
    if e2e:
        lines.append(f"torchtitan: {e2e['torchtitan']}; targets: {e2e['targets']}")
        ratios = e2e.get("vs_torchtitan") or vs_torchtitan(e2e["rows"])
        for config, r in ratios.items():
            verdict = "-" if r["ratio"] is None else ("met" if r["ratio"] >= 1.1 else "**missed**")
            lines.append(
                f"- {config}: llmtrain / torchtitan tokens/s = {_fmt(r['ratio'], '.2f')} "
                f"({_fmt(r['ours_tokens_per_s'], '.0f')} / {_fmt(r['torchtitan_tokens_per_s'], '.0f')}; "
                f"target >= 1.1: {verdict}; ours: {r['ours_variant'] or '-'}"
                + (f"; {r['why']}" if r.get("why") else "")
                + ")"
            )
        lines += [
            "",
            "| config | overrides | compile | tokens/s | TFLOP/s | MFU (bf16 peak) | peak GiB | impl "
            "| status |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in e2e["rows"]:
            over = " ".join(o for o in r["overrides"] if not o.startswith("model.kernels"))
            cells = [
                r["config"],
                over,
                r["compile"],
                _fmt(r.get("tokens_per_s"), ".0f"),
                _fmt(r.get("tflops"), ".1f"),
            ]
            cells += [
                _fmt(r.get("mfu_vs_bf16_peak"), ".1%"),
                _fmt(r.get("peak_memory_gib"), ".1f"),
                r.get("impl", "llmtrain"),
                r["status"],
            ]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        lines.append("no e2e.json")
    curves = results.get("loss_curves")
    lines += ["", "## Loss curves against fp32", ""]
    if curves:
        for p, gap in curves["worst_relative_gap_to_fp32"].items():
            ok = "within" if curves["within_bound"][p] else "OUTSIDE"
            lines.append(
                f"- {p}: worst per-step relative gap {gap:.4f}, {ok} the bound {curves['bounds'][p]:.4f}"
            )
        if curves.get("worst_relative_gap_fp8_to_bf16") is not None:
            gap, bound = curves["worst_relative_gap_fp8_to_bf16"], curves["bound_fp8_to_bf16"]
            ok = "within" if curves["within_bound"]["fp8_vs_bf16"] else "OUTSIDE"
            lines.append(
                f"- fp8 against bf16: worst per-step relative gap {gap:.4f}, {ok} the bound {bound:.4f}"
            )
        lines.append("- final losses: " + ", ".join(f"{p} {c[-1]:.4f}" for p, c in curves["curves"].items()))
    else:
        lines.append("no loss_curves.json")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    results = {
        "env": _load(folder, "env.json"),
        "steps": _steps(folder),
        "tests": _tests(folder),
        "kernels": _load(folder, "kernels.json"),
        "e2e": _load(folder, "e2e.json"),
        "loss_curves": _load(folder, "loss_curves.json"),
    }
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (folder / "README.md").write_text(markdown(results))
    print(f"results: {folder / 'README.md'} and {folder / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
