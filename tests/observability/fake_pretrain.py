"""Stand-in for tools/pretrain.py in sweep tests: same CLI, validates with the real config loader, and
writes a metrics.jsonl whose figures are simple functions of the settings (so tests can predict them).

Also appends its output_dir to $FAKE_PRETRAIN_CALLS, so tests can count invocations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from llmtrain.config import ConfigError, load


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
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mbs, steps = job.train.micro_batch_size, job.train.steps
    with open(out / "metrics.jsonl", "w") as metrics:
        for step in range(1, steps + 1):
            entry = {
                "step": step,
                "loss": 10.0 / step + mbs,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_sec": 1000.0 * mbs * step,
                "elapsed_s": float(step),
                "mfu": 0.01 * mbs,
                "peak_memory_gb": 0.5 * mbs,
            }
            metrics.write(json.dumps(entry) + "\n")
        metrics.write(json.dumps({"step": steps, "eval_loss": 1.0 + mbs}) + "\n")
    print(f"done: {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
