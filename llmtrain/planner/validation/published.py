"""Validation of the cost model against published measurements (Narayanan et al. 2021, Table 1).

Each published row gives the GPT model (heads, hidden, layers; vocabulary 51200, sequence 2048), tp, pp,
GPU count, global batch and the measured TFLOP/s per GPU, counted with the paper's formula
96*B*s*l*h^2*(1 + s/(6h) + V/(16lh)), i.e. with full activation recomputation, which the paper's runs used.
The prediction fixes everything the paper states (tp, pp, dp, full recomputation, no sequence parallelism,
no ZeRO, Megatron-2021 software behaviour, the default 1F1B schedule, and the micro-batch size where a
table's optional `micro_batch` column states it) and lets the planner choose only what the table leaves
open (Table 1 states no micro-batch size). One cluster file and one model for every row; no per-row
factors; `provenance` reports which cluster constants, if any, cite the table (were set from its rows).
Then the planner's own best layout for the same model, GPUs and batch is compared with it.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from llmtrain.config.errors import ConfigError
from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.flops import megatron_flops_per_iteration
from llmtrain.planner.cost.layout import Software, Workload
from llmtrain.planner.cost.model import Estimate
from llmtrain.planner.search.uniform import plan

REFERENCE = resources.files("llmtrain.planner") / "data" / "megatron_a100_2021.csv"
"""The published table, shipped as package data (its header names the source)."""
COLUMNS = ("params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "global_batch", "tflops_per_gpu")
"""What a table needs: the model, the published layout and its measured throughput."""
OPTIONAL = ("micro_batch",)
"""Columns a row may leave blank: the micro-batch size, fixed where the source states it."""
CITES_TABLE = ("2104.04473", "Narayanan", "megatron_a100_2021")
"""Text a constant's source would contain if it were set from the validation table."""


def load_reference(path: str | Path | None = None) -> list[dict[str, float]]:
    """Rows of a published table (default: the packaged one) as dicts of numbers, comment lines skipped."""
    table = Path(path) if path else REFERENCE
    if not table.is_file():
        raise ConfigError(
            f"reference table {table} does not exist; pass a CSV with the columns of {REFERENCE} "
            "or leave --reference out to use that one"
        )
    lines = [line for line in table.read_text().splitlines() if line.strip() and not line.startswith("#")]
    reader = csv.DictReader(lines)
    missing = sorted(set(COLUMNS) - set(reader.fieldnames or ()))
    if missing:
        raise ConfigError(f"reference table {table} lacks the column(s) {', '.join(missing)}")
    rows = []
    for number, row in enumerate(reader, start=1):
        try:
            # An optional column may be left blank where the source does not state it (micro_batch).
            rows.append({k: float(v) for k, v in row.items() if k not in OPTIONAL or (v or "").strip()})
        except (TypeError, ValueError):
            raise ConfigError(f"reference table {table}: data row {number} is not all numbers") from None
    return rows


def gpt_model(row: dict[str, float]) -> ModelConfig:
    """The GPT of a published row (dropout 0.1 as Megatron's GPT runs)."""
    return ModelConfig(
        arch="gpt",
        num_layers=int(row["layers"]),
        hidden_size=int(row["hidden"]),
        num_attention_heads=int(row["heads"]),
        vocab_size=51200,
        seq_length=2048,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )


@dataclass
class RowResult:
    """One published row: its prediction and the planner's own best."""

    row: dict[str, float]
    published: Estimate
    predicted_tflops: float
    """TFLOP/s per GPU with the paper's formula over the predicted step time."""
    error: float
    """predicted / measured - 1."""
    interleaved_tflops: float
    """The same with the interleaved schedule (best virtual stages), for reference."""
    best: Estimate

    @property
    def best_speedup(self) -> float:
        """Predicted step time of the published layout over that of the planner's best (>= 1: not worse)."""
        return self.published.step_time / self.best.step_time


def validate_megatron(
    cluster: Cluster | str = "a100-80gb", path: str | Path | None = None
) -> list[RowResult]:
    """Predict every published row and the planner's best for it."""
    cl = load_cluster(cluster) if isinstance(cluster, str) else cluster
    software = Software.megatron_2021()
    out = []
    for row in load_reference(path):
        model = gpt_model(row)
        gpus, tp, pp, batch = int(row["gpus"]), int(row["tp"]), int(row["pp"]), int(row["global_batch"])
        work = Workload(model, batch, "fp16")
        fixed: dict[str, object] = {
            "tp": tp,
            "pp": pp,
            "dp": gpus // (tp * pp),
            "recompute": "full",
            "sequence_parallel": False,
            "zero_stage": 0,
            "schedule": "1f1b",
            "virtual_stages": 1,
        }
        if "micro_batch" in row:
            fixed["micro_batch"] = int(row["micro_batch"])
        published = plan(work, cl, gpus, fixed, software, top=1).fitting()[0]
        flops = megatron_flops_per_iteration(
            batch, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
        )
        predicted = flops / published.step_time / gpus / 1e12
        interleaved = dict(fixed, schedule="interleaved_1f1b")
        del interleaved["virtual_stages"]
        inter = plan(work, cl, gpus, interleaved, software, top=1).fitting() if pp > 1 else [published]
        inter_tflops = flops / inter[0].step_time / gpus / 1e12 if inter else float("nan")
        best = plan(work, cl, gpus, None, software, top=5).fitting()[0]
        out.append(
            RowResult(row, published, predicted, predicted / row["tflops_per_gpu"] - 1, inter_tflops, best)
        )
    return out


def provenance(cluster: Cluster | str = "a100-80gb") -> str:
    """Where the cluster's constants come from: those whose source cites the validation table (set from its
    rows), those without a source, and how many are assumptions rather than specifications or
    measurements."""
    cl = load_cluster(cluster) if isinstance(cluster, str) else cluster
    fitted = [k for k, v in cl.sources.items() if any(c in v for c in CITES_TABLE)]
    assumed = [k for k, v in cl.sources.items() if v.lstrip().startswith("assumption")]
    unsourced = cl.unsourced()
    return "\n".join(
        [
            f"constants of {cl.name} set from the validation table's rows: {', '.join(fitted) or 'none'}",
            f"constants without a source: {', '.join(unsourced) or 'none'}",
            f"{len(cl.sources) - len(assumed)} constants from vendor specifications, published benchmarks or "
            f"calibration runs; {len(assumed)} assumptions ({', '.join(assumed) or 'none'})",
        ]
    )


def summary(results: list[RowResult]) -> dict[str, float]:
    """Median and max |error| of the predictions, and the worst best-vs-published speedup."""
    errors = [abs(r.error) for r in results]
    return {
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "min_best_speedup": min(r.best_speedup for r in results),
    }


def format_results(results: list[RowResult]) -> str:
    """The validation table."""
    head = (
        f"{'params_B':>8} {'tp':>3} {'pp':>3} {'gpus':>5} {'batch':>5} {'meas':>6} {'pred':>6} {'err':>6} "
        f"{'mb':>3} {'interl':>6}  planner best (speedup over published layout)"
    )
    lines = [head]
    for r in results:
        row, lay = r.row, r.best.layout
        lines.append(
            f"{row['params_b']:8.1f} {int(row['tp']):3d} {int(row['pp']):3d} {int(row['gpus']):5d} "
            f"{int(row['global_batch']):5d} {row['tflops_per_gpu']:6.1f} {r.predicted_tflops:6.1f} "
            f"{100 * r.error:+5.1f}% {r.published.layout.micro_batch:3d} {r.interleaved_tflops:6.1f}  "
            f"{lay.short()} ({r.best_speedup:.2f}x)"
        )
    stated = sum("micro_batch" in r.row for r in results)
    lines.append(
        f"micro-batch size fixed from the table in {stated} of {len(results)} rows"
        + ("" if stated == len(results) else "; the planner chooses it (mb column) where the table is silent")
    )
    s = summary(results)
    lines.append(
        f"median |error| {100 * s['median_abs_error']:.1f}%, max |error| {100 * s['max_abs_error']:.1f}%; "
        f"planner best vs published layout: min speedup {s['min_best_speedup']:.3f}x"
    )
    return "\n".join(lines)
