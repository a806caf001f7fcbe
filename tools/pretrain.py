"""Train a model: `python tools/pretrain.py --config configs/ernie.yaml [key.path=value ...]`.

Runs on one process with `python`, or on many with `torchrun --nproc_per_node N tools/pretrain.py ...`.
"""

from __future__ import annotations

import argparse
import os
import sys

from llmtrain.config import ConfigError, load
from llmtrain.data import DataError
from llmtrain.training import TrainingDiverged, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML job config, e.g. configs/ernie.yaml")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=20")
    args = parser.parse_args(argv)
    try:
        job = load(args.config, args.overrides)
        result = run(job)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        print(f"training stopped: {err}", file=sys.stderr)
        return 3
    if os.environ.get("RANK", "0") != "0":
        return 0
    eval_text = f", eval loss {result.final_eval_loss:.4f}" if result.final_eval_loss is not None else ""
    print(f"done: {result.steps} steps in {result.elapsed_s:.1f}s, loss {result.final_loss:.4f}{eval_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
