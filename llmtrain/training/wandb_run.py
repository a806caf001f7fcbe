"""Weights & Biases for a run (logging.wandb): one W&B run per output_dir run, resumed by its later launches.

Rank 0's MetricsLogger opens it once the launch is committed (so a login or network problem stops the
launch at its start, not at the first logged step), sends every metrics entry's scalars under their
TensorBoard tags at the entry's step, and finishes it with the launch's exit code. The W&B run's id is kept in
<output_dir>/wandb/run_id: a later launch into the same output_dir (a rerun that resumes, an elastic restart)
resumes that W&B run (resume="allow"), and checkpoint.archive_existing moves the id away with the rest of the
run, so the fresh run gets a W&B run of its own. W&B writes its own files under <output_dir>/wandb/ too (with
WANDB_MODE=offline all of them; `wandb sync` uploads them later).

W&B keeps only increasing steps. A resumed launch redoes the steps after its checkpoint that an earlier
launch may have logged already; those entries are not sent again (metrics.jsonl has them, and a resume
reproduces their losses).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from llmtrain.config import JobConfig, to_dict
from llmtrain.errors import UserError
from llmtrain.training.metrics_file import read_rows

WANDB_DIR = "wandb"
RUN_ID = "run_id"


class WandbError(UserError, RuntimeError):
    """W&B could not start or resume the run (not logged in, no network, a refused project)."""


class WandbRun:
    """The W&B run of this launch, on rank 0."""

    def __init__(self, run: Any, logged_through: int) -> None:
        self.run = run
        self.logged_through = logged_through
        """The last step earlier launches logged to this W&B run (0 for a new one): not sent again."""

    @classmethod
    def open(cls, job: JobConfig) -> WandbRun:
        """Start the W&B run of job.output_dir, or resume the one an earlier launch started there."""
        import wandb

        out = Path(job.output_dir)
        folder = out / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        w = job.logging.wandb
        try:
            run = wandb.init(
                project=w.project,
                entity=w.entity,
                name=w.name or out.resolve().name,
                tags=w.tags or None,
                config=to_dict(job),
                allow_val_change=True,  # a later launch may change the config (e.g. raise train.steps)
                dir=str(out),
                id=run_id or secrets.token_hex(4),
                resume="allow",
            )
        except Exception as err:  # wandb raises its own and plain errors for login and network problems
            raise WandbError(
                f"logging.wandb.project={w.project}: W&B could not start the run ({type(err).__name__}: "
                f"{err}); run `wandb login`, or set WANDB_MODE=offline to log to {folder} and upload later "
                "with `wandb sync`"
            ) from err
        if run_id is None:
            tmp = id_file.with_name(f".{RUN_ID}.tmp{os.getpid()}")
            tmp.write_text(run.id + "\n")
            tmp.replace(id_file)
            logged_through = 0
        else:
            logged_through = max((int(row["step"]) for row in read_rows(out)), default=0)
        return cls(run, logged_through)

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Send one entry's scalars at `step` (unless an earlier launch logged that step)."""
        if step > self.logged_through:
            self.run.log(scalars, step=step)

    def finish(self, exit_code: int) -> None:
        """Close the W&B run: finished for 0, failed otherwise (a stopped run resumes it on its rerun)."""
        self.run.finish(exit_code=exit_code)
