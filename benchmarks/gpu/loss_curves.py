"""bf16 (and fp8) training loss curves against fp32's on one device, from the same weights and batches.

A small LLaMA (configs/llama-small.yaml, the PyTorch or Triton kernels) trains for `--steps` steps on
learnable token sequences (each row counts up from a random start modulo the vocabulary, so the loss
falls steadily towards 0) in fp32, bf16 and fp8. Reported: each precision's curve, its worst per-step
relative gap to fp32's, and whether that stays within the bound argued below.

Bounds: bf16 keeps 8 mantissa bits (rounding 2^-9 relative); the repository's CPU test of bf16 against the
same run at another layout measured under 4% per step over 20 steps at lr 1e-2 and allows 5%
(tests/parallel/test_features.py); the same 5% is used here at this config's lower lr. fp8 (e4m3, 2^-4
rounding per GEMM operand) was measured within 0.7% of bf16 on CPU (tests/training/test_fp8.py allows
2^-5 against bf16); against fp32 we allow 5% + 2^-5, and fp8 against bf16 directly 2^-5 (FP8_VS_BF16).

--cpu trains a small LLaMA (SMALL_CPU: 2 layers, hidden 64, 512 tokens a step, GEMM sizes multiples of 16)
on one CPU thread, torchao's float8 included (it runs on CPU), for --steps steps (200 here: a few minutes),
and --plot draws the curves (docs/images/fp8_vs_bf16_cpu.png):

  python benchmarks/gpu/loss_curves.py --out curves.json            # on a GPU
  python benchmarks/gpu/loss_curves.py --dry-run --out /tmp/c.json  # tiny, on CPU
  python benchmarks/gpu/loss_curves.py --cpu --steps 200 --out /tmp/c.json --plot /tmp/c.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import build_training  # noqa: E402
from common import ROOT, device_name, peer_version, write_json  # noqa: E402

from llmtrain.training.lr_schedule import learning_rate  # noqa: E402

BOUNDS = {"bf16": 0.05, "fp8": 0.05 + 2**-5}
FP8_VS_BF16 = 2**-5
"""fp8's worst per-step relative gap to bf16 (tests/training/test_fp8.py's LOSS_BOUND, argued there)."""
CONFIG = ROOT / "configs" / "llama-small.yaml"
# GEMM dimensions multiples of 16 for fp8: hidden 256, ffn 704 (8/3 * 256 rounded up to 64), 16 x 128 tokens.
COMMON = ["train.warmup_steps=10", "train.lr=1e-3", "train.min_lr=1e-4"]
DRY_RUN = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
]
DRY_RUN += ["model.vocab_size=256", "model.seq_length=32", "train.micro_batch_size=2", "model.kernels=torch"]
# --cpu: DRY_RUN's model on 8 x 64 tokens a step (ffn 192: every float8 GEMM dimension a multiple of 16).
SMALL_CPU = [*DRY_RUN[:5], "model.seq_length=64", "train.micro_batch_size=8", "model.kernels=torch"]


def learnable_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    starts = torch.randint(0, vocab, (steps, batch, 1), generator=g)
    return list((starts + torch.arange(seq + 1)) % vocab)


def curve(precision: str, overrides: list[str], steps: int, device: str) -> list[float]:
    job, model, optimizer = build_training(
        CONFIG, [*overrides, f"train.precision={precision}", f"train.steps={steps}"], "none", device
    )
    batches = learnable_batches(steps, job.train.micro_batch_size, job.model.seq_length, job.model.vocab_size)
    losses = []
    for step, tokens in enumerate(batches):
        tokens = tokens.to(device)
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        optimizer.backward(loss)
        optimizer.step(learning_rate(job.train, step))
        losses.append(loss.item())
    return losses


def write_results(
    out: Path, curves: dict[str, list[float]], overrides: list[str], steps: int, device: str
) -> dict[str, bool]:
    """Each finished curve's worst per-step relative gap to fp32's and its verdict, written to `out`."""
    gaps = {p: max(abs(a - b) / b for a, b in zip(c, curves["fp32"], strict=True)) for p, c in curves.items()}
    gaps.pop("fp32")
    verdict = {p: gaps[p] <= BOUNDS[p] for p in gaps}
    for p in gaps:
        print(f"{p}: worst per-step relative gap to fp32 {gaps[p]:.4f} (bound {BOUNDS[p]:.4f}): {verdict[p]}")
    fp8_bf16 = None
    if "fp8" in curves and "bf16" in curves:
        fp8_bf16 = max(abs(a - b) / b for a, b in zip(curves["fp8"], curves["bf16"], strict=True))
        verdict["fp8_vs_bf16"] = fp8_bf16 <= FP8_VS_BF16
        print(
            f"fp8: worst per-step relative gap to bf16 {fp8_bf16:.4f} (bound {FP8_VS_BF16:.4f}): "
            f"{verdict['fp8_vs_bf16']}"
        )
    write_json(
        out,
        {
            "step": "loss_curves",
            "device": device_name(device),
            "config": str(CONFIG.relative_to(ROOT)),
            "overrides": overrides,
            "steps": steps,
            "worst_relative_gap_to_fp32": gaps,
            "bounds": BOUNDS,
            "worst_relative_gap_fp8_to_bf16": fp8_bf16,
            "bound_fp8_to_bf16": FP8_VS_BF16,
            "within_bound": verdict,
            "curves": curves,
            "torchao": peer_version("torchao"),
        },
    )
    return verdict


def plot(path: Path, curves: dict[str, list[float]], title: str) -> None:
    """The loss curves and fp8's relative gap to bf16 per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.0), sharex=True, height_ratios=(2, 1))
    for precision, losses in curves.items():
        top.plot(range(1, len(losses) + 1), losses, label=precision, linewidth=1)
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    gap = [100 * (a - b) / b for a, b in zip(curves["fp8"], curves["bf16"], strict=True)]
    bottom.plot(range(1, len(gap) + 1), gap, color="C2", linewidth=1)
    for sign in (1, -1):
        bottom.axhline(sign * 100 * FP8_VS_BF16, color="grey", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("fp8 - bf16 (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--cpu", action="store_true", help="SMALL_CPU on one CPU thread, --steps steps")
    parser.add_argument("--plot", type=Path, help="also draw the curves into this PNG")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, overrides, steps = "cpu", COMMON + DRY_RUN, 6
    elif args.cpu:
        # One thread: on a shared machine more threads than free cores slow every small GEMM many times over.
        torch.set_num_threads(1)
        device, overrides, steps = "cpu", COMMON + SMALL_CPU, args.steps
    elif torch.cuda.is_available():
        device, overrides, steps = "cuda", [*COMMON, "model.kernels=triton"], args.steps
    else:
        print("loss_curves.py needs a CUDA GPU (or --dry-run on CPU); none found.")
        return 2
    # fp8 needs torchao; without it the fp8 curve is reported as not installed rather than failing the step.
    fp8 = peer_version("torchao") != "not installed"
    precisions = ("fp32", "bf16", "fp8") if fp8 else ("fp32", "bf16")
    curves: dict[str, list[float]] = {}
    verdict: dict[str, bool] = {}
    for precision in precisions:
        start = time.perf_counter()
        curves[precision] = curve(precision, overrides, steps, device)
        print(
            f"{precision}: {steps} steps in {time.perf_counter() - start:.1f} s, "
            f"final loss {curves[precision][-1]:.4f}",
            flush=True,
        )
        # Written after every curve: a step stopped by its time budget keeps the curves it finished.
        verdict = write_results(args.out, curves, overrides, steps, device)
    print("final losses: " + ", ".join(f"{p} {c[-1]:.4f}" for p, c in curves.items()))
    if args.plot and "fp8" in curves:
        shape = " with SMALL_CPU's shapes, one CPU thread" if args.cpu else f" on {device_name(device)}"
        plot(args.plot, curves, f"{CONFIG.stem}{shape}, {steps} steps")
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
