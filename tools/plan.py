"""Plan the parallel layout of a training job: a ranked table of predicted step time, throughput and memory.

    python tools/plan.py --config configs/ernie.yaml --cluster a100-80gb --gpus 64 --global-batch 512
    python tools/plan.py --config MODEL.yaml --cluster h100-80gb --gpus 3072 --json --top 3
    # fix some settings, search the rest:
    python tools/plan.py --config MODEL.yaml --gpus 512 --evaluate "parallel.tp=8 model.recompute=full"
    python tools/plan.py --config MODEL.yaml --cluster a100-80gb --gpus 64 --write best.yaml --plot plan.png
    # recompute per layer and layers per pipeline chunk as well (written with --write):
    python tools/plan.py --config MODEL.yaml --cluster h100-80gb --gpus 3072 --per-layer
    # memory per rank of the config's own layout (settings changeable with --evaluate):
    python tools/plan.py --config configs/llama3-70b.yaml --cluster h100-80gb --gpus 64 --memory \\
        --evaluate "parallel.tp=4 parallel.zero_stage=3 model.recompute=full"
    # long sequences split over cp ranks, MoE experts over ep ranks (searched, or fixed):
    python tools/plan.py --config configs/llama3-405b.yaml --cluster h100-80gb --gpus 16384 \\
        model.seq_length=131072 train.global_batch_size=128
    python tools/plan.py --config configs/mixtral-8x7b.yaml --cluster h200-141gb --gpus 64 \\
        --evaluate "parallel.ep=8"
    python tools/plan.py --profile-local --output my-cluster.yaml   # measure this machine
    python tools/plan.py --config MODEL.yaml --cluster my-cluster.yaml --gpus 2

--cluster takes a shipped preset by name (a100-40gb, a100-80gb, h100-80gb, h100-96gb-500w, h200-141gb: one
node type, any --gpus; mixed-h100-a100: 16 H100 + 16 A100, planned as a whole with uneven splits) or the path
of a cluster YAML file (tools/calibrate.py writes one for this machine). A cluster of several node kinds also
gets the fastest uneven split (layers per pipeline stage or micro-batches per data-parallel replica, in
proportion to device speed) and its gain over the even split; --write writes it when it is faster.

After the table it explains the choice (--no-explain: not): the best layout's step time split (compute,
recompute, exposed TP / pipeline / DP communication, bubble, optimizer), its memory per rank, and the best
layout of each other (tp, pp, zero, recompute) family with what ruled it out. --json prints
{"layouts": [...], "explanation": {...}, "per_layer": {...}} (the last two null when not asked for).
"""

from __future__ import annotations

import argparse

from llmtrain.cli import add_debug_flag, run_tool

SOFTWARE = ("llmtrain", "llmtrain-whole-model", "megatron-2021")
"""Framework behaviours the cost model knows (llmtrain.planner.Software: llmtrain as it is;
Software.whole_model_init: llmtrain before sharded construction and ZeRO-2/3; Software.megatron_2021)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line (kept free of library imports so that --help answers at once)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="model/job YAML (the model, precision and batch come from it)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the config")
    parser.add_argument(
        "--cluster",
        default="a100-80gb",
        help="cluster YAML path or preset (a100-40gb, a100-80gb, h100-80gb, h100-96gb-500w, h200-141gb, "
        "mixed-h100-a100)",
    )
    parser.add_argument("--gpus", type=int, help="number of GPUs")
    parser.add_argument(
        "--global-batch", type=int, help="samples per step (default: train.global_batch_size)"
    )
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--no-explain", action="store_true", help="leave out why the best layout won over the runners-up"
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="also search recompute per layer and layers per pipeline chunk from the best uniform layouts",
    )
    parser.add_argument(
        "--evaluate", help='fix settings, e.g. "parallel.tp=8 parallel.pp=2"; search the rest'
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="print the per-rank memory of the config's layout (changed by --evaluate) instead of searching",
    )
    parser.add_argument("--write", help="write the best layout as a training config YAML")
    parser.add_argument("--plot", help="draw time and memory breakdowns of the top layouts to this image")
    parser.add_argument("--software", choices=SOFTWARE, default="llmtrain", help="framework behaviour")
    parser.add_argument(
        "--profile-local", action="store_true", help="measure this machine, write a cluster file"
    )
    parser.add_argument(
        "--output", default="local-cluster.yaml", help="cluster file written by --profile-local"
    )
    parser.add_argument(
        "--devices", type=int, default=2, help="processes sharing this machine (--profile-local)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing --write/--plot/--output files"
    )
    add_debug_flag(parser)
    return parser


def profile_local(args: argparse.Namespace) -> int:
    """--profile-local: measure this machine and write it as a cluster file."""
    from llmtrain.config.loader import dump_yaml
    from llmtrain.planner.calibration.profile import describe_local
    from llmtrain.planner.report.files import check_new_file, write_yaml

    check_new_file(args.output, args.overwrite)  # before minutes of measuring, not after
    desc = describe_local(args.devices)
    write_yaml(desc, args.output, args.overwrite)
    print(f"wrote {args.output}:\n{dump_yaml(desc)}")
    return 0


def print_memory(job, args: argparse.Namespace, software) -> int:  # noqa: ANN001 (imports stay lazy)
    """--memory: the per-rank breakdown of the config's layout on --gpus devices of --cluster."""
    import json

    from llmtrain.config import ConfigError
    from llmtrain.planner import CostModel, Workload, load_cluster, parse_fixed
    from llmtrain.planner.cost.layout import layout_of_job
    from llmtrain.planner.report.tables import format_memory

    view = load_cluster(args.cluster).view(args.gpus)
    model = CostModel(Workload.from_job(job, args.global_batch), view, software)
    layout = layout_of_job(job, args.gpus, parse_fixed(args.evaluate))
    why = model.invalid_reason(layout)
    if why:
        raise ConfigError(f"--memory: layout {layout.short()} cannot run: {why}")
    estimate = model.evaluate(layout)
    if args.json:
        print(json.dumps(estimate.as_dict(), indent=1))
    else:
        print(format_memory(estimate, job.train.precision, f"{args.gpus} x {view.device.name}"))
    return 0


def main(argv: list[str]) -> int:
    """Parse arguments, plan, print; returns the exit status (bad input raises a UserError for run_tool)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.profile_local:
        return profile_local(args)
    if not args.config or not args.gpus:
        parser.error("--config and --gpus are required (or use --profile-local)")

    import json
    import sys

    from llmtrain.config import ConfigError, load
    from llmtrain.planner import CostModel, Software, load_cluster, parse_fixed, plan_job
    from llmtrain.planner.report.explain import explain, format_explanation
    from llmtrain.planner.report.files import check_new_file, write_config
    from llmtrain.planner.report.plot import plot
    from llmtrain.planner.report.tables import format_table, to_records
    from llmtrain.planner.search.hetero import HeteroPlanner
    from llmtrain.planner.search.per_layer import search_per_layer
    from llmtrain.planner.search.uniform import build_space

    for path in (args.write, args.plot):
        if path:
            check_new_file(path, args.overwrite)
    job = load(args.config, args.overrides)
    presets = {"megatron-2021": Software.megatron_2021, "llmtrain-whole-model": Software.whole_model_init}
    software = presets.get(args.software, Software)()
    if args.memory:
        return print_memory(job, args, software)
    cluster, fixed = load_cluster(args.cluster), parse_fixed(args.evaluate)
    view = cluster.view(args.gpus)
    result = plan_job(
        job,
        cluster,
        args.gpus,
        global_batch=args.global_batch,
        fixed=fixed,
        software=software,
        top=args.top,
    )
    why = None if args.no_explain else explain(result, view)
    per_layer = None
    if args.per_layer:
        model = CostModel(result.workload, view, software)
        per_layer = search_per_layer(model, build_space(model, fixed), result.ranked)
    # Several node kinds: the fastest uneven split (layers per stage or micro-batches per replica) of the
    # search's layouts, which ranked them on the slowest device (an even split runs at its pace).
    hetero = None
    if len(cluster.nodes) > 1:
        hetero = HeteroPlanner(result.workload, cluster, args.gpus, software).best(result.ranked, job)
    if args.json:
        out = {
            "layouts": to_records(result, args.top),
            "explanation": why.as_dict() if why else None,
            "per_layer": per_layer.as_dict() if per_layer else None,
            "heterogeneous": None
            if hetero is None
            else {
                "layout": hetero.layout.short(),
                "devices": list(hetero.devices),
                "overrides": hetero.overrides(),
                "step_time_s": hetero.step_time,
                "closed_form_step_time_s": hetero.closed_form_step_time,
                "even_step_time_s": hetero.even_step_time,
                "best_even_step_time_s": result.best.step_time,
            },
        }
        print(json.dumps(out, indent=1))
    else:
        print(format_table(result, args.top))
        if why:
            print(
                "\n" + format_explanation(why, result.workload.precision, f"{args.gpus} x {view.device.name}")
            )
        if per_layer:
            print("\n" + per_layer.format())
        if hetero:
            best_even = result.best.step_time
            print(
                f"\n{hetero.format()}; {best_even / hetero.step_time:.2f}x the best even layout's "
                f"{best_even:.3f}s ({result.best.layout.short()})"
            )
    chosen = per_layer.best if per_layer else result.best
    uneven: tuple[int, ...] = ()
    if hetero and hetero.step_time < chosen.step_time:
        chosen, uneven = hetero.estimate, hetero.dp_micro_batches
    if args.write:
        if not chosen.fits:
            raise ConfigError(f"no layout fits in memory ({chosen.why}); nothing written to {args.write}")
        write_config(job, chosen, args.write, result.workload.global_batch, args.overwrite, uneven)
        print(f"wrote {args.write} ({chosen.layout.short()})", file=sys.stderr)
    if args.plot:
        plot(result, args.plot, args.top, args.overwrite)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_tool(main)
