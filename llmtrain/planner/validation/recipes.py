"""The cost model against published training recipes of today's frameworks (dense, MoE, long context).

Each table (package data, llmtrain/planner/data/*.csv; its header comment names the page, the FLOPs
convention and the page's wording of the layout) gives per row the model (a shipped config of configs/), the
hardware (a cluster preset), the precision, the GPUs, the global batch, the layout the page states (tp, pp,
cp, virtual stages, ep, FSDP or DDP, micro-batch and recompute where stated) and the measured step time or
tokens per second per GPU. A step time is compared, global_batch * seq_length / (tokens/s/GPU * GPUs) where
the page gives throughput, so no FLOPs formula enters the comparison. Where a page runs the pipeline schedule
several times a step (NeMo AutoModel's GA: the optional pipeline_runs column), the prediction is that many
runs of global_batch / runs, each with its gradient reduction, and one optimizer step.

The prediction fixes what the row states and lets the planner choose only what the page leaves open
(sequence parallelism, recompute where unstated), as the Megatron 2021 validation does (published.py). A row
the planner cannot express is never dropped: it is kept with the reason (a model not in configs/, hardware
no cluster file describes or one missing a constant, a recompute mode the planner does not model, a page
without a batch size); FP8 rows are priced by the FP8 cost model, under the software of their table
(TABLE_SOFTWARE). A table whose rows set a cluster constant (the constant's source names the table) is
reported but kept out of the score. Then the planner's own best layout for the
same model, GPUs and batch is compared with the published one: its predicted gain, the step-time part that
shrinks most, and whether it fits (a prediction, not a measured speed-up).
"""

from __future__ import annotations

import csv
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from llmtrain.config.errors import ConfigError
from llmtrain.config.loader import load, resolve_config
from llmtrain.config.schema import ModelConfig
from llmtrain.planner.cluster.files import load_cluster
from llmtrain.planner.cluster.hardware import Cluster
from llmtrain.planner.cost.layout import Software, Workload
from llmtrain.planner.cost.model import CostModel, Estimate
from llmtrain.planner.report.explain import PART_LABELS, time_parts
from llmtrain.planner.search.uniform import plan

DATA = resources.files("llmtrain.planner") / "data"
TABLES = (
    "megatron_bridge_h100",
    "nemo_automodel_h100",
    "torchtitan_a100",
    "torchtitan_h100",
    "nemo_long_sequence_h100",
)
"""The published recipe tables shipped with the package (file stems under data/)."""
COLUMNS = (
    "release", "model", "cluster", "precision", "gpus", "global_batch", "micro_batch", "seq_length",
    "tp", "pp", "cp", "vp", "ep", "fsdp", "recompute", "measured_step_s", "tokens_per_gpu_s",
)  # fmt: skip
"""What a recipe table needs (blank where the page does not state it). Optional columns: kind (moe for a
model not in configs/), pipeline_runs (schedule runs a step) and software ('+'-joined Software flags the
row's run turns on beyond its table's software, e.g. async_tp, or with a leading '-' turns off, e.g.
-fused_kernels: SOFTWARE_FLAGS)."""
SOFTWARE_FLAGS = ("async_tp", "fused_kernels", "compiled_float8")
"""Software flags a row may set (its software column: `flag` on, `-flag` off): what a page varies between rows
of one table (torchtitan's: async TP, and torch.compile, which fuses the elementwise ops its eager rows run
as separate PyTorch operators and, under float8, the scaling into the kernels producing the activations)."""
MODELLED_PRECISIONS = ("bf16", "fp16", "fp8")
"""Precisions the cost model describes (fp8: the blocks' linears in float8, llmtrain.planner.cost)."""
PUBLISHED_SOFTWARE = Software(fused_ring_attention=True, fused_moe_permute=True)
"""The frameworks of the tables (Megatron-Core with Transformer Engine, NeMo AutoModel, torchtitan): as
llmtrain on a GPU (flash attention, fused kernels, overlapped gradient reduction) except that their ring
context parallelism runs flash-attention kernels per block pair and their MoE layers permute the routed
rows with fused kernels."""
MEGATRON_CORE_SOFTWARE = replace(PUBLISHED_SOFTWARE, te_fp8=True, tp_comm_overlap=True, causal_skip=True)
"""Megatron-Core with Transformer Engine as Megatron-Bridge's performance recipes run it: FP8 linears as
Transformer Engine runs them (fused cast-transposes, weights cast once per step, float8 inputs saved, FP8
grouped GEMMs), tensor-parallel communication overlapped with the GEMMs (the recipes' tp_comm_overlap), and
cuDNN's fused attention computing only the causal half of the scores. Booleans of what the framework does,
no constant set from a table; the other tables keep PUBLISHED_SOFTWARE (docs/planner.md says what
causal_skip does to their rows)."""
TORCHTITAN_SOFTWARE = replace(PUBLISHED_SOFTWARE, tp_saves_gathered_input=True, float8_tp=True)
"""torchtitan's tensor parallelism (its llama3 parallelize.apply_tp): DTensor's sequence parallelism, each
region's input gathered once by PrepareModuleInput and kept gathered for the backward of the column-parallel
linears, and under its default tensorwise float8 torchao's Float8ColwiseParallel, Float8RowwiseParallel and
PrepareFloat8ModuleInput, whose all-gathers carry float8 (the region inputs forward, the row-parallel
outputs' gradients backward). Booleans of what the framework does; no constant set from a table."""
TABLE_SOFTWARE = {
    "megatron_bridge_h100": MEGATRON_CORE_SOFTWARE,
    "torchtitan_a100": TORCHTITAN_SOFTWARE,
    "torchtitan_h100": TORCHTITAN_SOFTWARE,
}
"""Software of a table where it differs from PUBLISHED_SOFTWARE."""
LONG_CONTEXT = 16384
"""Sequences of at least this many tokens count as long context."""
RECOMPUTE = ("none", "selective", "full", "every_second_layer", "selective_op")
"""Recompute wordings of the tables the planner expresses (every_second_layer: layers alternately full and
none, torchtitan's "selective layer" checkpointing; selective_op: torchtitan's op-level policy, which the
cost model prices (CostBase.op_sac_linears) though llmtrain's trainer does not run it)."""


@dataclass
class Recipe:
    """One published row: what it states, and its prediction or why it has none."""

    table: str
    row: dict[str, str]
    kind: str
    """dense, moe or long (sequence >= LONG_CONTEXT)."""
    measured: float | None
    """Published step time (s), given or from tokens/s/GPU; None where the page allows neither."""
    skipped: str = ""
    """Why the planner cannot evaluate the row (empty: evaluated)."""
    published: Estimate | None = None
    best: Estimate | None = None
    tuned: bool = False
    """A cluster constant was set from this row's table: reported, kept out of the score."""
    notes: list[str] = field(default_factory=list)
    runs: int = 1
    """Pipeline runs per step (the table's pipeline_runs): `published` is one run over global_batch / runs."""

    @property
    def predicted(self) -> float:
        """Predicted step time of the published layout: its runs, then one optimizer step."""
        assert self.published is not None
        return self.runs * (self.published.step_time - self.published.optimizer) + self.published.optimizer

    @property
    def error(self) -> float:
        """predicted / measured step time - 1."""
        assert self.measured
        return self.predicted / self.measured - 1

    @property
    def gain(self) -> float:
        """Predicted step time of the published layout over the planner's best (>= 1: not worse)."""
        assert self.best is not None
        return self.predicted / self.best.step_time

    @property
    def gain_reason(self) -> str:
        """The step-time part that shrinks most from the published layout to the planner's best."""
        assert self.published is not None and self.best is not None
        mine = {k: v * (1 if k == "optimizer" else self.runs) for k, v in time_parts(self.published).items()}
        best = time_parts(self.best)
        key = max(mine, key=lambda k: mine[k] - best[k])
        return f"{PART_LABELS[key]} -{mine[key] - best[key]:.2f} s"

    def label(self) -> str:
        r = self.row
        return f"{r['model']} {r['gpus']}x{r['cluster']} {r['precision']} ({r['release']})"


def table_path(name: str) -> Path:
    """The packaged table `name` (a stem of TABLES) or a CSV path."""
    if name in TABLES:
        return Path(str(DATA / f"{name}.csv"))
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"recipe table {name} does not exist; pass a CSV with the columns {', '.join(COLUMNS)} or one of "
            f"{', '.join(TABLES)}"
        )
    return path


def load_recipes(name: str) -> list[dict[str, str]]:
    """Rows of a recipe table as dicts of stripped strings, comment lines skipped."""
    path = table_path(name)
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(f"recipe table {path} lacks the column(s) {', '.join(missing)}")
    return [{k: (v or "").strip() for k, v in row.items()} for row in reader]


def _int(row: dict[str, str], key: str, default: int = 1) -> int:
    return int(row[key]) if row[key] else default


def measured_step(row: dict[str, str]) -> float | None:
    """The published step time: given, or global batch x sequence over the tokens per second of all GPUs."""
    if row["measured_step_s"]:
        return float(row["measured_step_s"])
    if row["global_batch"] and row["tokens_per_gpu_s"]:
        tokens = int(row["global_batch"]) * int(row["seq_length"])
        return tokens / (float(row["tokens_per_gpu_s"]) * int(row["gpus"]))
    return None


def fixed_layout(row: dict[str, str], num_layers: int) -> dict[str, object]:
    """The Layout fields the row states (the planner chooses the rest)."""
    tp, pp, cp, ep, vp = (_int(row, k) for k in ("tp", "pp", "cp", "ep", "vp"))
    fixed: dict[str, object] = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    if cp > 1:
        fixed["cp_comm"] = "ring"  # Transformer Engine's default (p2p) and torchtitan's context parallelism
    fixed["dp"] = int(row["gpus"]) // (tp * pp * cp)
    if pp > 1:
        fixed["schedule"] = "interleaved_1f1b" if vp > 1 else "1f1b"
        fixed["virtual_stages"] = vp
    if row["fsdp"]:
        # FSDP: parameters, gradients and optimizer state sharded over all of dp (zero 3, no hybrid sharding,
        # no offload); DDP as Megatron runs it, with the distributed optimizer (zero 1).
        fixed.update(zero_stage=3 if int(row["fsdp"]) else 1, dp_shard=None, offload="none")
    if row["micro_batch"]:
        fixed["micro_batch"] = int(row["micro_batch"])
    mode = row["recompute"]
    if mode == "every_second_layer":
        fixed["layer_recompute"] = tuple("full" if i % 2 == 0 else "none" for i in range(num_layers))
    elif mode:
        fixed["recompute"] = mode
    return fixed


def cluster_problem(cluster: Cluster, precision: str) -> str:
    """Why `cluster` cannot price `precision` (a constant the file lacks); empty when it can."""
    for group in cluster.nodes:
        if precision not in group.device.peak_tflops:
            return f"cluster {cluster.name} lacks devices.{group.device.name}.peak_tflops.{precision}"
    return ""


@functools.cache
def zoo_model(name: str) -> ModelConfig | None:
    """The model of the shipped config `name` (configs/), None if there is none."""
    try:
        return load(resolve_config(name)).model
    except ConfigError:
        return None


@functools.cache
def known_cluster(name: str) -> Cluster | None:
    """The cluster preset or file `name`, None if there is none."""
    try:
        return load_cluster(name)
    except ConfigError:
        return None


def row_flags(row: dict[str, str]) -> dict[str, bool]:
    """The Software flags the row's optional software column sets: `flag` on, `-flag` off."""
    items = [item for item in (row.get("software") or "").split("+") if item]
    return {item.removeprefix("-"): not item.startswith("-") for item in items}


def row_software(table: str, row: dict[str, str]) -> Software:
    """The software of the row's run: its table's (TABLE_SOFTWARE), with the row's own flags set."""
    return replace(TABLE_SOFTWARE.get(table, PUBLISHED_SOFTWARE), **row_flags(row))  # type: ignore[arg-type]


def express(table: str, row: dict[str, str]) -> Recipe:
    """The row as the planner sees it: its kind and measured time, and a skip reason if it has one."""
    measured = measured_step(row)
    seq = int(row["seq_length"])
    # The kind of a model not in configs/: the row's optional kind column, else expert parallelism means MoE.
    moe = row.get("kind") == "moe" or _int(row, "ep") > 1
    kind = "long" if seq >= LONG_CONTEXT else "moe" if moe else "dense"
    recipe = Recipe(table, row, kind, measured)
    reasons = []
    model = zoo_model(row["model"])
    if model is None:
        reasons.append(f"model {row['model']} is not in the zoo (configs/)")
    elif model.is_moe and kind == "dense":
        recipe.kind = "moe"
    if row["precision"] not in MODELLED_PRECISIONS:
        reasons.append(f"{row['precision']} is not modelled yet (the cost model prices bf16/fp16 only)")
    cluster = known_cluster(row["cluster"])
    if cluster is None:
        reasons.append(f"no cluster file describes {row['cluster']} (no shipped preset)")
    elif row["precision"] in MODELLED_PRECISIONS and (problem := cluster_problem(cluster, row["precision"])):
        reasons.append(problem)
    for flag in row_flags(row):
        if flag not in SOFTWARE_FLAGS:
            reasons.append(f"software {flag!r} is not a flag a row may set ({', '.join(SOFTWARE_FLAGS)})")
    if row["recompute"] and row["recompute"] not in RECOMPUTE:
        reasons.append(f"recompute {row['recompute']!r} is not a mode the planner models")
    if measured is None:
        reasons.append("the page states no global batch: no step time to compare")
    recipe.skipped = "; ".join(reasons)
    return recipe


def evaluate(recipe: Recipe, search_best: bool = True) -> Recipe:
    """Predict the row's published layout and (search_best) the planner's best on the same GPUs and batch."""
    row = recipe.row
    overrides = [
        f"model.seq_length={row['seq_length']}",
        f"model.max_position_embeddings={row['seq_length']}",
    ]
    if zoo_model(row["model"]).is_moe:  # type: ignore[union-attr]
        # Both MoE pages force-balance the routing ("fake balanced gate", "force-balance the token
        # distribution"): no router loss, which also lets llmtrain recompute MoE layers in full.
        overrides += ["model.router_aux_loss_coef=0", "model.router_z_loss_coef=0"]
    model = load(resolve_config(row["model"]), overrides).model
    recipe.runs = int(row.get("pipeline_runs") or 1)
    work = Workload(model, int(row["global_batch"]) // recipe.runs, row["precision"])
    cluster = load_cluster(row["cluster"])
    gpus = int(row["gpus"])
    software = row_software(recipe.table, row)
    fixed = fixed_layout(row, model.num_layers)
    per_layer = fixed.pop("layer_recompute", None)
    if row.get("pipeline_runs") and fixed.get("zero_stage") == 3:
        fixed["grad_reduce"] = "step"  # FSDP's reduction once per run, after its last micro-batch
    try:
        recipe.published = plan(work, cluster, gpus, fixed, software, top=1).ranked[0]
        if per_layer:
            # Per-layer recompute is evaluated on the layout searched with the rest fixed (the search itself
            # varies one mode for every layer).
            layout = replace(recipe.published.layout, layer_recompute=per_layer)
            recipe.published = CostModel(work, cluster.view(gpus), software).evaluate(layout)
    except (ConfigError, ValueError) as err:
        recipe.published = None
        recipe.skipped = f"the planner rejects the published layout: {err}"
        return recipe
    if not recipe.published.fits:
        recipe.notes.append(f"predicted not to fit ({recipe.published.why})")
    if search_best:
        # The same framework (its ring attention is flash attention, its FSDP does not offload) and the same
        # batch, in one pipeline run per step.
        whole = Workload(model, int(row["global_batch"]), row["precision"])
        best = plan(whole, cluster, gpus, {"offload": "none"}, software, top=1)
        fitting = best.fitting()
        recipe.best = fitting[0] if fitting else best.ranked[0]
    return recipe


def tuned_tables(clusters: list[str]) -> dict[str, list[str]]:
    """For each table, the cluster constants whose source names it (set from its rows)."""
    out: dict[str, list[str]] = {}
    for name in clusters:
        cluster = load_cluster(name)
        for key, source in cluster.sources.items():
            for table in TABLES:
                if table in source:
                    out.setdefault(table, []).append(f"{name}:{key}")
    return out


def validate_recipes(
    tables: tuple[str, ...] = TABLES,
    search_best: bool = True,
    on_row: Callable[[int, int, Recipe], None] | None = None,
) -> list[Recipe]:
    """Every row of `tables`: evaluated, or kept with the reason it is not. `on_row(i, n, recipe)` after each
    of the n rows (the planner's own search makes a row take seconds to minutes: a caller shows progress)."""
    recipes = [express(t, row) for t in tables for row in load_recipes(t)]
    presets = sorted({r.row["cluster"] for r in recipes if not r.skipped})
    tuned = tuned_tables(presets)
    for i, recipe in enumerate(recipes, 1):
        recipe.tuned = recipe.table in tuned
        if not recipe.skipped:
            evaluate(recipe, search_best)
        if on_row is not None:
            on_row(i, len(recipes), recipe)
    return recipes


def scored(recipes: list[Recipe]) -> list[Recipe]:
    """The rows that count: evaluated and not from a table a constant was set from."""
    return [r for r in recipes if r.published is not None and not r.tuned]


def summarise(recipes: list[Recipe]) -> dict[str, dict[str, float]]:
    """Median and max |error| and the count of scored rows, per table and per kind (dense, moe, long)."""
    groups: dict[str, list[float]] = {}
    for r in scored(recipes):
        for key in (r.table, r.kind, "all"):
            groups.setdefault(key, []).append(abs(r.error))
    return {
        key: {"rows": len(errs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
        for key, errs in groups.items()
    }


def format_recipes(recipes: list[Recipe]) -> str:
    """Per row: published and predicted step time, error, the planner's best and its gain; then skips and
    the summary per table and per kind."""
    lines = [
        f"{'table':24s} {'row':44s} {'kind':5s} {'meas_s':>7s} {'pred_s':>7s} {'err':>6s}  "
        "published layout as predicted | planner best (gain, what shrinks, fits)"
    ]
    for r in recipes:
        if r.published is None:
            continue
        tail = ""
        if r.best is not None:
            fits = "fits" if r.best.fits else "does not fit"
            tail = f" | {r.best.layout.short()} ({r.gain:.2f}x, {r.gain_reason}, {fits})"
        mark = " [tuned: not scored]" if r.tuned else ""
        runs = f" x{r.runs} runs" if r.runs > 1 else ""
        lines.append(
            f"{r.table:24s} {r.label():44s} {r.kind:5s} {r.measured:7.2f} {r.predicted:7.2f} "
            f"{100 * r.error:+5.1f}%  {r.published.layout.short()}{runs}{tail}{mark}"
            + (f"  ({'; '.join(r.notes)})" if r.notes else "")
        )
    skipped = [r for r in recipes if r.published is None]
    lines.append(f"rows not evaluated: {len(skipped)} of {len(recipes)}")
    for r in skipped:
        lines.append(f"  skipped {r.table}: {r.label()} [{r.kind}]: {r.skipped}")
    tuned = tuned_tables(sorted({r.row["cluster"] for r in recipes if r.published is not None}))
    for table in dict.fromkeys(r.table for r in recipes):
        lines.append(
            f"constants set from {table}: {', '.join(tuned.get(table, [])) or 'none'}"
            + ("; its rows are kept out of the score" if table in tuned else "")
        )
    summary = summarise(recipes)
    for key in (*dict.fromkeys(r.table for r in recipes), "dense", "moe", "long", "all"):
        s = summary.get(key)
        if s is None:
            lines.append(f"{key}: no scored rows")
            continue
        lines.append(
            f"{key}: {s['rows']} scored rows, median |error| {100 * s['median_abs_error']:.1f}%, "
            f"max |error| {100 * s['max_abs_error']:.1f}%"
        )
    gains = [r.gain for r in recipes if r.best is not None and r.published is not None]
    if gains:
        lines.append(
            f"planner best vs published layout (predicted): median gain {statistics.median(gains):.2f}x, "
            f"min {min(gains):.2f}x, max {max(gains):.2f}x over {len(gains)} rows"
        )
    return "\n".join(lines)
