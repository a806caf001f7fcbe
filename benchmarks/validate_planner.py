"""Validate the planner's cost model against Megatron-LM's published A100 runs (Narayanan et al. 2021) and
today's published recipes (Megatron-Bridge, NeMo AutoModel, NeMo long sequence, torchtitan).

    python benchmarks/validate_planner.py [--cluster a100-80gb] [--reference PATH] [--json out.json]
        [--tables nemo_automodel_h100,torchtitan_a100] [--no-recipes]

Prints, per published configuration, the measured and predicted TFLOP/s per GPU and the error, the
median and max |error| (targets 5% and 10%), the planner's own best layout with its predicted speedup
over the published one (target >= 1), in how many rows the micro-batch size was fixed from the table, and
which cluster constants, if any, were set from the table's rows (a constant whose source cites it). The
published table ships with the package (llmtrain/planner/data/megatron_a100_2021.csv, its header naming
the paper); --reference reads another.

Then every row of the recipe tables (llmtrain/planner/validation/recipes.py; the CSVs ship in
llmtrain/planner/data/, each header naming its page and FLOPs convention): the published layout evaluated,
measured and predicted step time and error, the planner's own best layout for the same GPUs and batch with
its predicted gain, the step-time part that shrinks most and whether it fits (FP8 rows through the FP8
cost model); the rows it cannot express (a model not in configs/, hardware without a cluster file, ...)
listed with the reason; which cluster constants were set from each table (those rows are not scored); and
median and max |error| per table and per kind (dense, MoE, long context). --tables picks tables (names or
CSV paths).

With --activations it also compares the predicted saved-activation bytes of one layer with the bytes the
tensor-parallel issue's saved-tensor hooks measure (llmtrain.parallel.memory) on small CPU models.

With --local it also trains a small LLaMA for a few steps with torchrun on gloo in 12 (tp, pp, dp) layouts of
1-2 processes (one core each; ZeRO 0-3, recompute none/selective/full, SP) and prints, per layout, the
predicted and measured step time and |predicted - measured| / measured, then the median and max error
against issue 19's target (median <= 15%) and the Spearman rank correlation
(llmtrain.planner.validation.local, whose docstring says why not 3-4 processes on 2 cores; about 4 minutes
on 2 cores, twice that with --local-repeats 2). The cluster is the one tools/calibrate.py measured:

    python tools/calibrate.py --output local.yaml && \
        python benchmarks/validate_planner.py --local --local-cluster local.yaml
        [--local-steps 6] [--local-repeats 2]  # round-robin repeats, fastest median each: steadier if shared

With --regret it measures the planner's pick against the layouts it rejected (issue 38 point 4;
llmtrain.planner.validation.regret): for a dense and an MoE small job (--regret-models) at 2 and 4 processes
(--regret-processes), the layouts of the planner's search space cut by the rule it prints, each trained as
--local's are, then per (job, N) the line `regret of parallel.auto's pick (JOB, N processes): ...` (the
pick's measured time over the fastest, target <= 1.05) and the Spearman of predicted vs measured; progress and
the total time on stderr, the rows in --json under "regret". After the first pass, a confirmation round:
the pick and every layout whose first run is within --regret-band (default 1.30) of the fastest are measured
--regret-confirm (default 2) more times round-robin, each counting its fastest run (the table marks them
with their number of runs; --regret-confirm 0: one run per layout). --regret-limit K measures only the
first K layouts of each set (the pick first), a quick end-to-end check. The 4-process cluster is
`tools/calibrate.py --devices 4`'s file (--local-cluster4: 4 processes sharing the cores):

    python tools/calibrate.py --output local.yaml && \
        python tools/calibrate.py --output local4.yaml --devices 4 && \
        python benchmarks/validate_planner.py --no-recipes --regret --local-cluster local.yaml \
        --local-cluster4 local4.yaml

Without --local-cluster it profiles the machine now (tools/plan.py --profile-local's compute and memory
measurements with loopback link defaults), which leaves the links unmeasured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from llmtrain.config import ConfigError
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.layout import Layout
from llmtrain.planner.validation.local import (
    LOCAL_CONFIG,
    LOCAL_LAYOUTS,
    LOCAL_MODEL_OVERRIDES,
    LocalPoint,
    format_local,
    local_summary,
    median_step_time,
    predict,
    run_overrides,
)
from llmtrain.planner.validation.published import format_results, provenance, summary, validate_megatron
from llmtrain.planner.validation.recipes import TABLES, Recipe, format_recipes, summarise, validate_recipes
from llmtrain.planner.validation.regret import (
    REGRET_BAND,
    REGRET_CONFIRM,
    REGRET_JOBS,
    REGRET_PROCESSES,
    RegretResult,
    format_regret,
    regret_check,
    stderr_progress,
)

REPO = Path(__file__).resolve().parents[1]


def activation_check() -> str:
    """Predicted vs measured saved-activation bytes of one layer (tp=1, bf16, torch kernels on CPU)."""
    import torch

    from llmtrain.config.schema import ModelConfig
    from llmtrain.models import build
    from llmtrain.parallel.memory import measure_layer_bytes
    from llmtrain.planner import CostModel, Workload, load_cluster

    lines = ["arch   dropout  measured_bytes  predicted_bytes  ratio"]
    for arch, drop in (("gpt", 0.0), ("gpt", 0.1), ("llama", 0.0), ("ernie", 0.0)):
        kv = None if arch == "gpt" else 2
        cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=256, num_attention_heads=4, num_kv_heads=kv,
                          vocab_size=512, seq_length=128, hidden_dropout=drop, attention_dropout=drop,
                          kernels="torch")  # fmt: skip
        torch.manual_seed(0)
        model = build(cfg).to(torch.bfloat16).train()
        measured = measure_layer_bytes(model, 0, 2, cfg.seq_length)
        predicted = CostModel(
            Workload(cfg, 8, "bf16"), load_cluster("a100-80gb").view(1)
        ).activation_bytes_per_layer(1, 2, False, "none")
        lines.append(
            f"{arch:6s} {drop:7.1f}  {measured:14d}  {int(predicted):15d}  {predicted / measured:5.2f}"
        )
    return "\n".join(lines)


def recipe_record(recipe: Recipe) -> dict:
    """One recipe row for --json: what the table states, the prediction or the skip reason, the best."""
    out: dict = {"table": recipe.table, "kind": recipe.kind, "measured_s": recipe.measured, **recipe.row}
    out.update(skipped=recipe.skipped, tuned=recipe.tuned)
    if recipe.published is not None:
        out.update(
            predicted_s=recipe.predicted,
            pipeline_runs=recipe.runs,
            error=recipe.error,
            published_layout=recipe.published.layout.short(),
            fits=recipe.published.fits,
        )
    if recipe.best is not None:
        out.update(
            best_layout=recipe.best.layout.short(),
            best_gain=recipe.gain,
            best_reason=recipe.gain_reason,
            best_fits=recipe.best.fits,
        )
    return out


def measure_step_time(
    layout: Layout,
    steps: int,
    warmup: int,
    output_dir: Path,
    config: str = LOCAL_CONFIG,
    model_overrides: Sequence[str] = LOCAL_MODEL_OVERRIDES,
) -> float:
    """Median step time of a short torchrun (gloo) training run of the local job (or `config` with
    `model_overrides`) in `layout`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={layout.gpus}",
        "tools/pretrain.py", "--config", config, *model_overrides,
        *run_overrides(layout, steps, str(output_dir)),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(
            f"training run for {layout.short()} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return median_step_time((output_dir / "metrics.jsonl").read_text().splitlines(), warmup)


def recipe_progress():
    """A line on stderr per published row as it is priced and searched (the whole table takes minutes)."""
    start = time.monotonic()

    def line(i: int, n: int, recipe: Recipe) -> None:
        what = f"skipped ({recipe.skipped})" if recipe.skipped else "evaluated"
        print(f"[validate] row {i}/{n} {recipe.table}: {recipe.label()} {what}, "
              f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    return line


def local_cluster(cluster_file: str | None, devices: int = 2) -> Cluster:
    """The cluster of this machine for `devices` processes: the file given (tools/calibrate.py's, with
    --devices `devices`), else a profile measured now."""
    from llmtrain.planner import cluster_from_dict, load_cluster

    if cluster_file:
        return load_cluster(cluster_file)
    from llmtrain.planner.calibration.profile import describe_local

    start = time.perf_counter()
    # `devices` processes sharing the machine, as its layouts run. Links: profile.py's loopback
    # defaults, since its gloo measurement times its loops per rank, so the ranks can run different
    # numbers of all-reduces and abort or hang; tools/calibrate.py's file measures them (--local-cluster).
    desc = describe_local(devices, measure_links=False)
    device = next(iter(desc["devices"].values()))
    print(
        f"profiled this machine in {time.perf_counter() - start:.1f} s: {device['peak_tflops']} TFLOP/s, "
        f"{device['memory_bandwidth_gbs']} GB/s per process; link {desc['links']['intra_node']}",
        file=sys.stderr,
    )
    return cluster_from_dict(desc, f"describe_local({devices})")


def local_check(cluster: Cluster, steps: int, warmup: int, repeats: int = 1) -> list[LocalPoint]:
    """Predicted and measured step time of every local layout, the fastest of `repeats` runs each."""
    from llmtrain.config import load
    from llmtrain.planner import Workload

    workload = Workload.from_job(load(REPO / LOCAL_CONFIG, list(LOCAL_MODEL_OVERRIDES)))
    predicted = [predict(workload, cluster, layout).step_time for layout in LOCAL_LAYOUTS]
    measured: list[list[float]] = [[] for _ in LOCAL_LAYOUTS]
    with tempfile.TemporaryDirectory(prefix="validate-local-") as tmp:
        # Round-robin over the layouts, so a burst of other load on a shared machine hits one repeat of
        # several layouts rather than every repeat of one.
        for rep in range(repeats):
            for i, layout in enumerate(LOCAL_LAYOUTS):
                start = time.perf_counter()
                measured[i].append(measure_step_time(layout, steps, warmup, Path(tmp) / f"run{i}-{rep}"))
                print(
                    f"[{rep * len(LOCAL_LAYOUTS) + i + 1}/{repeats * len(LOCAL_LAYOUTS)}] {layout.short()}: "
                    f"predicted {predicted[i]:.4f} s, measured {measured[i][-1]:.4f} s "
                    f"({time.perf_counter() - start:.0f} s run)",
                    file=sys.stderr,
                )
    # Other load only ever slows a run down: the fastest repeat is the closest to this layout's own time.
    return [LocalPoint(lay, p, min(m)) for lay, p, m in zip(LOCAL_LAYOUTS, predicted, measured, strict=True)]


def run_measurer(
    workdir: Path, name: str, steps: int, warmup: int, repeats: int
) -> Callable[[Layout], float]:
    """Measures a layout of REGRET_JOBS[name]: the fastest median of `repeats` training runs (other load only
    slows a run down), each in a fresh directory under `workdir`."""
    config, overrides = REGRET_JOBS[name]
    runs = itertools.count()

    def measure(layout: Layout) -> float:
        return min(
            measure_step_time(layout, steps, warmup, workdir / f"{name}-{next(runs)}", config, overrides)
            for _ in range(repeats)
        )

    return measure


def regret_runs(
    jobs: Sequence[str],
    clusters: dict[int, Cluster],
    steps: int,
    warmup: int,
    repeats: int = 1,
    limit: int | None = None,
    band: float = REGRET_BAND,
    confirm: int = REGRET_CONFIRM,
) -> list[RegretResult]:
    """The regret check of every job at every process count of `clusters` (contenders within `band` measured
    `confirm` more times), progress and the total time on stderr."""
    from llmtrain.config import load

    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="validate-regret-") as tmp:
        for name in jobs:
            config, overrides = REGRET_JOBS[name]
            job = load(REPO / config, list(overrides))
            measure = run_measurer(Path(tmp), name, steps, warmup, repeats)
            for processes, cluster in clusters.items():
                results.append(
                    regret_check(
                        name, job, cluster, processes, measure, limit, stderr_progress, band, confirm
                    )
                )
    print(f"[regret] {len(results)} (job, processes) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the validation and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", default="a100-80gb", help="cluster YAML or preset (one for every row)")
    parser.add_argument(
        "--reference", help="published table CSV (default: llmtrain/planner/data/megatron_a100_2021.csv)"
    )
    parser.add_argument("--json", help="also write the per-row results to this JSON file")
    parser.add_argument(
        "--tables", default=",".join(TABLES), help="recipe tables to validate (comma-separated names or CSVs)"
    )
    parser.add_argument("--no-recipes", action="store_true", help="only the 2021 Megatron table")
    parser.add_argument(
        "--activations", action="store_true", help="also check activation bytes (needs torch)"
    )
    parser.add_argument(
        "--local", action="store_true", help="also predict vs measure step time on this machine (gloo)"
    )
    parser.add_argument(
        "--local-cluster",
        help="cluster file of this machine for --local, from tools/calibrate.py (default: profile it now)",
    )
    parser.add_argument("--local-steps", type=int, default=6, help="training steps per --local run")
    parser.add_argument("--local-warmup", type=int, default=2, help="steps left out of the --local median")
    parser.add_argument(
        "--local-repeats", type=int, default=1, help="--local runs per layout; the fastest median counts"
    )
    parser.add_argument(
        "--regret",
        action="store_true",
        help="measure the planner's pick against the layouts it rejected (planner.validation.regret)",
    )
    parser.add_argument(
        "--regret-models", default=",".join(REGRET_JOBS), help="--regret jobs (comma-separated: dense,moe)"
    )
    parser.add_argument(
        "--regret-processes",
        default=",".join(map(str, REGRET_PROCESSES)),
        help="--regret process counts (comma-separated)",
    )
    parser.add_argument(
        "--regret-limit", type=int, help="measure only the first K layouts of each set (the pick first)"
    )
    parser.add_argument(
        "--regret-band",
        type=float,
        default=REGRET_BAND,
        help="re-measure the layouts whose first run is within this factor of the fastest, and the pick "
        "(planner.validation.regret.REGRET_BAND argues the default)",
    )
    parser.add_argument(
        "--regret-confirm",
        type=int,
        default=REGRET_CONFIRM,
        help="runs of each such contender after its first, round-robin; the fastest counts (0: none)",
    )
    parser.add_argument(
        "--local-cluster4",
        help="cluster file for the 4-process --regret layouts (tools/calibrate.py --devices 4; "
        "default: profile it now)",
    )
    args = parser.parse_args(argv)
    regret_jobs = [j for j in args.regret_models.split(",") if j]
    if unknown := [j for j in regret_jobs if j not in REGRET_JOBS]:
        parser.error(f"--regret-models: unknown {', '.join(unknown)}; use some of {', '.join(REGRET_JOBS)}")
    try:
        regret_processes = [int(n) for n in args.regret_processes.split(",") if n]
    except ValueError:
        parser.error(f"--regret-processes: comma-separated integers; got {args.regret_processes!r}")
    if any(n < 1 for n in regret_processes):
        parser.error(f"--regret-processes: at least 1 each; got {args.regret_processes!r}")
    if args.regret_limit is not None and args.regret_limit < 1:
        parser.error("--regret-limit must be at least 1")
    if args.regret_band < 1:
        parser.error(
            f"--regret-band must be at least 1 (a factor of the fastest first run); got {args.regret_band}"
        )
    if args.regret_confirm < 0:
        parser.error(f"--regret-confirm must be at least 0 (runs after the first); got {args.regret_confirm}")
    if (args.local or args.regret) and args.local_steps <= args.local_warmup:
        parser.error("--local-steps must exceed --local-warmup")
    if (args.local or args.regret) and args.local_repeats < 1:
        parser.error("--local-repeats must be at least 1")
    try:
        # Before the Megatron and recipe tables (minutes of pricing) and the runs: a bad --local-cluster
        # fails at once.
        cluster = local_cluster(args.local_cluster) if args.local else None
        files = {2: args.local_cluster, 4: args.local_cluster4}
        regret_clusters = {n: local_cluster(files.get(n), n) for n in regret_processes} if args.regret else {}
        results = validate_megatron(args.cluster, args.reference)
        tables = tuple(t for t in args.tables.split(",") if t)
        recipes = [] if args.no_recipes else validate_recipes(tables, on_row=recipe_progress())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_results(results))
    print(provenance(args.cluster))
    if recipes:
        print(format_recipes(recipes))
    if args.activations:
        print(activation_check())
    local = []
    if args.local:
        local = local_check(cluster, args.local_steps, args.local_warmup, args.local_repeats)
        print(format_local(local))
    regret = []
    if args.regret:
        regret = regret_runs(
            regret_jobs, regret_clusters, args.local_steps, args.local_warmup, args.local_repeats,
            args.regret_limit, args.regret_band, args.regret_confirm,
        )  # fmt: skip
        print(format_regret(regret))
    if args.json:
        rows = [
            dict(
                r.row,
                predicted_tflops=r.predicted_tflops,
                error=r.error,
                interleaved_tflops=r.interleaved_tflops,
                published_layout=r.published.layout.short(),
                best_layout=r.best.layout.short(),
                best_speedup=r.best_speedup,
            )
            for r in results
        ]
        with open(args.json, "w") as fh:
            out = {"rows": rows, "summary": summary(results)}
            if recipes:
                out["recipes"] = {"rows": [recipe_record(r) for r in recipes], "summary": summarise(recipes)}
            if local:
                out["local"] = {
                    "rows": [
                        dict(
                            layout=p.layout.short(),
                            gpus=p.layout.gpus,
                            predicted_s=p.predicted,
                            measured_s=p.measured,
                            ratio=p.ratio,
                            error=p.error,
                        )
                        for p in local
                    ],
                    "summary": local_summary(local),
                }
            if regret:
                out["regret"] = [r.record() for r in regret]
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
