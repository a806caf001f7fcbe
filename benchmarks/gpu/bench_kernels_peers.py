"""Kernels against named peers at LLaMA-3-8B shapes in bf16, with the device's measured copy bandwidth.

RMSNorm, RoPE, SwiGLU, flash attention (causal, GQA, forward+backward), cross-entropy and fused linear
cross-entropy: our Triton kernels against PyTorch eager, torch.compile, SDPA (its default and its
flash backend), flash-attn 2 and Liger-Kernel where installed (benchmarks/bench_kernels.py builds the
cases). Memory-bound kernels are reported as a fraction of the copy bandwidth measured here, in this run.

  python benchmarks/gpu/bench_kernels_peers.py --out results/kernels.json           # on a GPU
  TRITON_INTERPRET=1 python benchmarks/gpu/bench_kernels_peers.py --dry-run --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, copy_bandwidth_gbps, device_name, peer_version, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_kernels  # noqa: E402

# Targets of issue 18, printed next to the measurements.
TARGETS = {
    "memory-bound kernels": ">= 85% of the measured copy bandwidth",
    "flash_attention fwd (hd 128, seq 8k, causal)": ">= 450 TFLOP/s",
    "fused_linear_ce": "at least as fast as Liger's, with no more memory",
}
# The kernels with targets go first, so a budget cut drops the cheap memory-bound ones last.
PRIORITY = ("flash_attention", "fused_linear_ce", "cross_entropy", "rms_norm", "swiglu", "rotary (q)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new kernel after this")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--kernels", nargs="+", default=(), help="run only these kernels (default: all)")
    args = parser.parse_args(argv)

    if args.dry_run:
        device, shape, dtype, reps, copy_bytes = "cpu", bench_kernels.SMOKE, torch.float32, 1, 2**24
    elif torch.cuda.is_available():
        device, shape, dtype, reps, copy_bytes = (
            "cuda",
            bench_kernels.LLAMA3_8B,
            torch.bfloat16,
            args.reps,
            2**31,
        )
    else:
        print("bench_kernels_peers.py needs a CUDA GPU (or --dry-run on CPU); none found.")
        return 2
    bandwidth = copy_bandwidth_gbps(device, copy_bytes)
    print(
        f"measured copy bandwidth: {bandwidth:.0f} GB/s (read + write of a {copy_bytes / 2**30:.2f} GiB copy)"
    )
    rows = bench_kernels.run_benchmarks(
        shape,
        device,
        dtype,
        reps,
        compile_ok=not (args.no_compile or args.dry_run),
        bandwidth_gbps=bandwidth,
        seconds=args.budget_s,
        first=PRIORITY,
        only=tuple(args.kernels),
    )
    write_json(
        args.out,
        {
            "step": "kernels",
            "device": device_name(device),
            "dtype": str(dtype),
            "shape": shape,
            "copy_bandwidth_gbps": bandwidth,
            "peers": {m: peer_version(m) for m in ("liger_kernel", "flash_attn")},
            "targets": TARGETS,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
