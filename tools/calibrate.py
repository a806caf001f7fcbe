"""Calibrate a cluster profile on this machine: measure it and write the YAML that tools/plan.py reads.

    python tools/calibrate.py --output my-cluster.yaml            # gloo groups of 2 and 4, a few minutes
    python tools/calibrate.py --output quick.yaml --quick          # fewer sizes and repeats (about a minute)
    python tools/plan.py --config MODEL.yaml --cluster my-cluster.yaml --gpus 2

Measures matmul TFLOP/s over shapes and dtypes (a table from small to large kernels, on one process's
share of the cores, that the cost model interpolates), the rate of the reference path's memory-bound
operators (a LLaMA block's and the cross-entropy's) from cache-sized to larger tensors, the host time per
dispatched operator, fused
attention, memory copy bandwidth, kernel launch overhead, host copy bandwidth and a host Adam step, and per
backend (gloo; nccl where GPUs allow) and group size all-reduce, all-gather, reduce-scatter and
point-to-point times over message sizes, kept as a table the cost model interpolates and fitted as alpha +
bytes / bandwidth (llmtrain.planner.calibration). Every constant of the written profile names this run as
its source; the raw measurements are kept under `calibration`.
"""

from __future__ import annotations

import argparse

from llmtrain.cli import add_debug_flag, run_tool


def build_parser() -> argparse.ArgumentParser:
    """The command line (free of library imports so that --help answers at once)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", default="calibrated-cluster.yaml", help="cluster YAML to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument(
        "--devices", type=int, default=2, help="processes (GPUs) per node the profile describes"
    )
    parser.add_argument(
        "--group-sizes", type=int, nargs="+", default=[2, 4], help="process-group sizes to time"
    )
    parser.add_argument(
        "--quick", action="store_true", help="5 message sizes, 5 repeats, shorter compute timings"
    )
    add_debug_flag(parser)
    return parser


def summary(m) -> str:  # noqa: ANN001 (imports stay lazy)
    """What was measured, one line per quantity."""
    lines = [f"{m.device} ({m.device_kind}), {m.devices} per node"]
    for dtype, shapes in m.gemm_tflops.items():
        lines.append(
            f"  matmul {dtype}: " + ", ".join(f"{s} {t:.3g}" for s, t in shapes.items()) + " TFLOP/s"
        )
    lines.append(
        f"  attention fwd+bwd {m.attention_tflops:.3g} TFLOP/s, copy {m.memory_bandwidth_gbs:.1f} GB/s"
    )
    lines.append(
        f"  kernel {m.launch_us:.1f} us, host copy {m.host_bandwidth_gbs:.1f} GB/s, "
        f"host Adam {m.host_adam_gparams:.3g} Gparams/s, {m.host_op_us:.1f} us host time per operator, "
        f"fresh pages {m.fresh_page_gbs:.3g} GB/s"
    )
    for dtype, points in m.gemm_table.items():
        lines.append(
            f"  matmul table {dtype} (GFLOP: TFLOP/s): "
            + ", ".join(f"{flops / 1e9:.3g}: {tflops:.3g}" for flops, tflops in points)
        )
    for name, points in m.memory_table.items():
        lines.append(
            f"  memory-bound {name} (MiB: GB/s): "
            + ", ".join(f"{nbytes / 2**20:.3g}: {gbs:.3g}" for nbytes, gbs in points)
        )
    for f in m.links:
        lines.append(
            f"  {f.backend} {f.op:14s} group {f.group}: alpha {f.alpha_s * 1e6:8.1f} us, "
            f"{f.bytes_per_s / 1e9:7.3f} GB/s; +{f.after_compute_s * 1e6:.0f} us after compute, "
            f"+{f.fsdp_call_s * 1e6:.0f} us per FSDP2 call"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Measure, write the profile, print a summary."""
    args = build_parser().parse_args(argv)
    from llmtrain.config import ConfigError
    from llmtrain.planner.calibration.measure import measure
    from llmtrain.planner.calibration.measurements import profile_of
    from llmtrain.planner.cluster.files import cluster_from_dict
    from llmtrain.planner.report.files import check_new_file, write_yaml

    if args.devices < 1 or min(args.group_sizes) < 2:
        raise ConfigError("--devices must be at least 1 and every --group-sizes entry at least 2")
    check_new_file(args.output, args.overwrite)  # before minutes of measuring, not after
    if args.quick:
        m = measure(args.devices, tuple(args.group_sizes), (2**10, 2**13, 2**16, 2**19, 2**22), 5, 0.1)
    else:
        m = measure(args.devices, tuple(args.group_sizes))
    profile = profile_of(m)
    cluster_from_dict(profile, args.output)  # what plan.py will read back
    write_yaml(profile, args.output, args.overwrite)
    print(summary(m))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_tool(main)
