"""Draw docs/images/muon_vs_adamw.png: training loss of configs/llama-small-muon.yaml (Muon, Moonlight's
recipe: AdamW's learning rate and weight decay reused through the match_rms_adamw adjustment) against the same
config with train.optimizer=adamw, over the same steps, data and seed, on CPU.

  python docs/images/draw_muon_vs_adamw.py                 # trains both (a few minutes on 2 idle cores)
  python docs/images/draw_muon_vs_adamw.py --steps 20 --runs /tmp/muon-check

Each run is tools/pretrain.py with train.steps=STEPS, a warmup of a tenth of them and no evaluation, into
RUNS/adamw and RUNS/muon (a finished run is not trained again); the figure and the printed table read their
metrics.jsonl.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmtrain.training.metrics_file import latest_per_step, read_rows  # noqa: E402

CONFIG = "configs/llama-small-muon.yaml"
RUNS = {"adamw": ["train.optimizer=adamw"], "muon": []}


def train(name: str, extra: list[str], steps: int, runs: Path, plot_only: bool) -> list[tuple[int, float]]:
    """(step, loss) of each step of the run `name`, trained first unless finished (or `plot_only`)."""
    out = runs / name
    overrides = [
        f"train.steps={steps}",
        f"train.warmup_steps={max(steps // 10, 1)}",
        "train.eval_interval=0",
        "logging.interval=1",
        f"output_dir={out}",
        *extra,
    ]
    if not plot_only:
        command = [sys.executable, str(ROOT / "tools" / "pretrain.py"), "--config", CONFIG, *overrides]
        subprocess.run(command, check=True)
    rows = [r for r in latest_per_step(read_rows(out)) if "loss" in r and "eval_loss" not in r]
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/llmtrain-muon-vs-adamw"))
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("muon_vs_adamw.png"))
    parser.add_argument(
        "--plot-only", action="store_true", help="draw the runs as they are, training nothing"
    )
    args = parser.parse_args(argv)
    curves = {name: train(name, extra, args.steps, args.runs, args.plot_only) for name, extra in RUNS.items()}
    print("| step | AdamW loss | Muon loss |\n|---|---|---|")
    adamw, muon = dict(curves["adamw"]), dict(curves["muon"])
    for step in sorted(adamw):
        if step % 10 == 0 or step == 1:
            print(f"| {step} | {adamw[step]:.3f} | {muon.get(step, float('nan')):.3f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, label in (("adamw", "AdamW (lr 2e-3)"), ("muon", "Muon + AdamW (lr 2e-3, match_rms_adamw)")):
        steps, losses = zip(*curves[name], strict=True)
        ax.plot(steps, losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    last = min(curves["adamw"][-1][0], curves["muon"][-1][0])
    ax.set_title(f"llama-small-muon on CPU, {last} of {args.steps} steps, same data and seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
