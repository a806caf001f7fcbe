"""Stand-in for tools/pretrain.py in sweep tests: same CLI, validates with the real config loader, and
appends to metrics.jsonl rows whose figures are simple functions of the settings (so tests can predict them).

Like the real tool it tags its rows with the launch's `segment` and says "nothing to do" (exit 0, no rows)
when the output_dir's metrics already reach train.steps. $FAKE_PRETRAIN_FAIL makes it fail with that text
on stderr before training; each call appends its output_dir to $FAKE_PRETRAIN_CALLS, so tests can count them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from llmtrain.config import ConfigError, load
from llmtrain.training.metrics_file import latest_per_step, next_segment, read_rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        job = load(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if os.environ.get("FAKE_PRETRAIN_CALLS"):
        with open(os.environ["FAKE_PRETRAIN_CALLS"], "a") as calls:
            calls.write(job.output_dir + "\n")
    if os.environ.get("FAKE_PRETRAIN_FAIL"):
        print(os.environ["FAKE_PRETRAIN_FAIL"], file=sys.stderr)
        return 1
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mbs, steps = job.train.micro_batch_size, job.train.steps
    logged = [row["step"] for row in latest_per_step(read_rows(out)) if "loss" in row]
    if logged and logged[-1] >= steps:
        print(f"nothing to do: {out} already reached step {logged[-1]} of train.steps={steps}")
        return 0
    segment = next_segment(out)
    with open(out / "metrics.jsonl", "a") as metrics:
        for step in range(1, steps + 1):
            entry = {
                "step": step,
                "segment": segment,
                "loss": 10.0 / step + mbs,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_sec": 1000.0 * mbs * step,
                "tflops_per_device": 0.001 * mbs * step,
                "elapsed_s": float(step),
                "mfu": 0.01 * mbs,
                "peak_memory_gb": 0.5 * mbs,
            }
            metrics.write(json.dumps(entry) + "\n")
        metrics.write(json.dumps({"step": steps, "segment": segment, "eval_loss": 1.0 + mbs}) + "\n")
    print(f"done: {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
