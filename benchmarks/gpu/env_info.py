"""The run's environment for the results folder: device, driver, library versions, host, git commit."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, device_name, nvidia_smi, versions, write_json  # noqa: E402


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True
        )
    except OSError:
        return "unknown (no git)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    write_json(
        args.out,
        {
            "step": "env",
            "device": device_name(device),
            "dry_run": args.dry_run,
            "nvidia_smi": nvidia_smi(),
            "versions": versions(),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "git_commit": git_commit(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
