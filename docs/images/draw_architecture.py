"""Draw docs/images/architecture.png: one training step's path through the packages (docs/architecture.md).

python docs/images/draw_architecture.py [--output PATH]
"""

import argparse
from pathlib import Path

# (what happens, the package that owns it), in the order tools/pretrain.py runs them.
STEPS = [
    ("load + validate\nthe YAML", "config"),
    ("build the model\non meta", "models"),
    ("apply_tp", "parallel"),
    ("apply_ep", "parallel"),
    ("apply_cp", "parallel"),
    ("apply_float8, apply_recompute,\napply_compile", "parallel"),
    ("pp > 1: split\ninto stages", "pipeline"),
    ("data parallel +\nmaterialize", "parallel"),
    ("optimizer,\ncheckpointer", "parallel / checkpoint"),
    ("Trainer.fit:\nsteps", "training"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("architecture.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_row = 5
    fig, ax = plt.subplots(figsize=(13, 4.2))
    for i, (what, package) in enumerate(STEPS):
        x, y = 2.6 * (i % per_row), -2.0 * (i // per_row)
        ax.add_patch(plt.Rectangle((x, y), 2.0, 1.1, facecolor="#dce9f7", edgecolor="#2b5d8c"))
        ax.text(x + 1.0, y + 0.62, what, ha="center", va="center", fontsize=10)
        ax.text(x + 1.0, y + 0.13, package, ha="center", va="center", fontsize=8, color="#2b5d8c")
        if i + 1 < len(STEPS) and (i + 1) % per_row:
            ax.annotate("", (x + 2.55, y + 0.55), (x + 2.05, y + 0.55), arrowprops={"arrowstyle": "->"})
    ax.annotate("", (1.0, -0.85), (2.6 * (per_row - 1) + 1.0, -0.05), arrowprops={"arrowstyle": "->"})
    ax.set_xlim(-0.2, 2.6 * per_row)
    ax.set_ylim(-2.2, 1.3)
    ax.axis("off")
    ax.set_title("tools/pretrain.py: config -> model on meta -> parallel layout -> pipeline -> trainer")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100, metadata={"Software": None})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
