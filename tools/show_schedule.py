"""Draw a pipeline schedule (simulated, or traced from a real run) as a PNG timeline and a Chrome trace.

    python tools/show_schedule.py --schedule interleaved_1f1b --pp 4 --microbatches 8 --virtual-stages 2 \
        --output schedule.png --chrome-trace schedule.json
"""

from __future__ import annotations

import argparse

from llmtrain.pipeline.schedules import SCHEDULES
from llmtrain.pipeline.timeline import show_schedule


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and draw."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved_1f1b)")
    parser.add_argument("--trace", help="per-rank start/end events JSON of a real run (executor trace)")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--chrome-trace", help="Chrome-trace JSON file to write")
    parser.add_argument("--forward", type=float, default=1.0, help="simulated forward time of one stage")
    parser.add_argument(
        "--backward", type=float, default=2.0, help="simulated full backward time of one stage"
    )
    parser.add_argument("--weight-grad", type=float, help="weight-gradient part of --backward (default half)")
    parser.add_argument("--p2p", type=float, default=0.0, help="simulated transfer latency")
    args = parser.parse_args(argv)
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
    print(f"wrote {args.output} (bubble fraction {bubble:.4f})")


if __name__ == "__main__":
    main()
