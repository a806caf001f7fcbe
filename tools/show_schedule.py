"""Draw a pipeline schedule (simulated, or traced from a real run) as a PNG timeline and a Chrome trace.

    python tools/show_schedule.py --schedule interleaved_1f1b --pp 4 --microbatches 8 --virtual-stages 2 \
        --output schedule.png --chrome-trace schedule.json
"""

from __future__ import annotations

import argparse
import math

from llmtrain.cli import add_debug_flag, run_tool


def _duration(text: str) -> float:
    """A simulated time: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--schedule", required=True, help="pipeline schedule, e.g. 1f1b (an unknown name lists the others)"
    )
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved_1f1b)")
    parser.add_argument("--trace", help="per-rank start/end events JSON of a real run (executor trace)")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--chrome-trace", help="Chrome-trace JSON file to write")
    parser.add_argument("--forward", type=_duration, default=1.0, help="simulated forward time of one stage")
    parser.add_argument(
        "--backward", type=_duration, default=2.0, help="simulated full backward time of one stage"
    )
    parser.add_argument(
        "--weight-grad", type=_duration, help="weight-gradient part of --backward (default half)"
    )
    parser.add_argument("--p2p", type=_duration, default=0.0, help="simulated transfer latency")
    add_debug_flag(parser)
    return parser


def main(argv: list[str]) -> int:
    """Parse arguments and draw."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.weight_grad is not None and args.weight_grad > args.backward:
        parser.error(f"--weight-grad {args.weight_grad:g} exceeds --backward {args.backward:g}")
    import json

    from llmtrain.errors import UserError
    from llmtrain.pipeline.schedules import SCHEDULES
    from llmtrain.pipeline.timeline import show_schedule

    if args.schedule not in SCHEDULES:
        parser.error(f"argument --schedule: {args.schedule!r} is not one of {', '.join(SCHEDULES)}")
    try:
        bubble = show_schedule(
            args.schedule,
            args.pp,
            args.microbatches,
            args.output,
            virtual_stages=args.virtual_stages,
            trace=args.trace,
            chrome_trace_path=args.chrome_trace,
            forward=args.forward,
            backward=args.backward,
            weight_grad=args.weight_grad,
            p2p=args.p2p,
        )
    except UserError:
        raise
    except json.JSONDecodeError as err:
        raise UserError(f"--trace {args.trace} is not valid JSON: {err}") from err
    except (OSError, ValueError) as err:
        # The simulated costs are checked above, so what is left is the --trace file (missing, not JSON,
        # events lacking a field) or an output path that cannot be written.
        raise UserError(str(err)) from err
    print(f"wrote {args.output} (bubble fraction {bubble:.4f})")
    return 0


if __name__ == "__main__":
    run_tool(main)
