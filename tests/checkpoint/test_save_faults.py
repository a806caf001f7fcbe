"""Faults during checkpoint saves: a rank SIGKILLed in each phase of a save (sync and async), damaged
checkpoints, full disks.

References: the same job run without a fault (after recovery every step's loss equals its loss, bit for
bit: resuming is exact on one layout), and the checksums in each checkpoint's manifest. The disk is made
full for real with RLIMIT_FSIZE (writes past the limit fail with EFBIG, as on a full disk with ENOSPC), and
one rank's full disk is injected (ENOSPC) through LLMTRAIN_FAULTS.

Each launch runs tools/pretrain.py as `python` or torchrun would, with its ranks forked from the preloaded
fork server (tests.checkpoint._ranks): what a launch leaves on disk and prints is checked here, not the
launcher (torchrun's restarts are tests/checkpoint/test_elastic.py's).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from llmtrain.checkpoint import Checkpointer, CheckpointError
from llmtrain.checkpoint.manager import last_good_checkpoint, verify
from llmtrain.config import ConfigError, load
from llmtrain.faults import ENV
from llmtrain.parallel import Topology
from llmtrain.training.metrics_file import latest_per_step, read_rows
from tests.checkpoint._ranks import tiny_pretrain as pretrain
from tests.checkpoint._util import build, tiny_job
from tests.training._runs import CONFIG

# Saves at steps 2, 4 and 6 (the last); keep=1, so the step-4 save also prunes step 2: the strictest case
# for "the previous checkpoint survives until the new one is published".
COMMON = (
    "train.steps=6",
    "checkpoint.interval=2",
    "checkpoint.interval_minutes=0",
    "checkpoint.keep=1",
    "logging.interval=1",
    "train.eval_interval=0",
)
TWO_RANKS = (*COMMON, "parallel.tp=2")  # both ranks write tensor shards
# A file-size limit above every other file a run writes (metrics, configs, RNG states, the tokenizer at
# 120 KB) and below the tensor shard (7 MB for this model with its Adam moments).
FILE_SIZE_LIMIT = 1 << 20
SINGLE = Topology.single()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _losses(out: Path) -> dict[int, float]:
    """The training loss of every step, as the run's launches last logged it."""
    return {r["step"]: r["loss"] for r in latest_per_step(read_rows(out)) if "loss" in r}


def _start_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("start "))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = pretrain(2, out, *TWO_RANKS)
    assert result.returncode == 0, result.stderr
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 7))
    return losses


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = pretrain(0, out, *COMMON)
    assert result.returncode == 0, result.stderr
    return _losses(out)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run stopped at train.steps=4 with checkpoints step_2 and step_4 (copied by each test)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    result = pretrain(0, out, *COMMON, "train.steps=4", "checkpoint.keep=2")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# (mode, phase, rank): every phase of llmtrain.checkpoint.manager.SAVE_PHASES on the rank that works in it
# ("swap" needs a step_<N> to replace and has its own test below); async for the phases that differ there
# (the staging copy on the training thread, writes on the background thread).
KILLS = [
    ("sync", "prepare", 0),
    ("sync", "shards", 1),
    ("sync", "metadata", 0),
    ("sync", "local_files", 1),
    ("sync", "manifest", 0),
    ("sync", "publish", 0),
    ("sync", "latest", 0),
    ("sync", "prune", 0),
    ("async", "stage", 1),
    ("async", "shards", 0),
    ("async", "publish", 0),
]
COUNTED = ("latest", "prune")  # killed once `latest` named the new checkpoint: the save counts
SKIPPED = {
    "prepare": ".tmp_step_4 (a save interrupted before it was published)",
    "publish": "step_4 (latest names step_2: this save did not complete)",
}
# The kills of a chain share one run: the launch that resumes after a kill is the launch the next kill
# stops (a launch resumed from step_2 saves step 4 again), and a launch without a fault ends the chain; a
# launch costs more than all its steps. Each kill meets what a fresh run killed there leaves (the
# run at step 4 with step_2 saved, keep=1, the debris of the kill before, which the original test's own
# resume also met), and each resume is checked as it was alone: its start line, and every step every
# launch logged against the run without a fault. A counted kill resumes from step_4, which saves no step 4
# again, so it ends its chain.
# Chains of three kills at most: a chain runs within the test that first asks for it (pytest's timeout).
CHAINS = [
    [("sync", "prepare", 0), ("sync", "shards", 1), ("sync", "metadata", 0)],
    [("sync", "local_files", 1), ("sync", "manifest", 0), ("sync", "latest", 0)],
    [("sync", "publish", 0), ("sync", "prune", 0)],
    [("async", "stage", 1), ("async", "shards", 0), ("async", "publish", 0)],
]
assert sorted(kill for chain in CHAINS for kill in chain) == sorted(KILLS)


def _start_or_error(result: subprocess.CompletedProcess) -> str:
    """The launch's start line, or its stderr when it printed none (for the assertion to show)."""
    return next((line for line in result.stdout.splitlines() if line.startswith("start ")), result.stderr)


def _run_chain(out: Path, chain: list[tuple[str, str, int]]) -> dict:
    """The launches of `chain` in one output folder: what each kill left (checked before the next launch)
    and the start line of the launch after it; the clean launch that ends the chain; every launch's rows."""
    overrides = (*TWO_RANKS, f"checkpoint.async_save={str(chain[0][0] == 'async').lower()}")
    root = out / "checkpoints"
    kills: dict[str, dict] = {}
    for _, phase, rank in chain:
        # A rendezvous port of its own for each launch: one found free minutes before may be taken since.
        killed = pretrain(2, out, *overrides, faults=f"kill_during_save:phase={phase}:rank={rank}:step=4")
        if kills:  # this launch resumed after the kill before it
            kills[next(reversed(kills))]["start"] = _start_or_error(killed)
        good = root / ("step_4" if phase in COUNTED else "step_2")
        try:
            verify(good)
            damage = None
        except CheckpointError as err:
            damage = str(err)
        kills[phase] = {"killed": killed, "good": good, "last_good": last_good_checkpoint(root)[0]}
        kills[phase]["damage"] = damage
    again = pretrain(2, out, *overrides)
    kills[next(reversed(kills))]["start"] = _start_or_error(again)
    return {
        "kills": kills,
        "again": again,
        "rows": [(r["step"], r["loss"]) for r in read_rows(out) if "loss" in r],
        "left": sorted(p.name for p in root.iterdir()),
    }


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory):
    """The chain of a kill, run at the first request for any of its kills (a chain that fails fails each of
    its kills' tests with the same error, without running again; also when pytest-timeout stops it, whose
    failure is a BaseException: otherwise the next kill's test would start the chain over)."""
    done: dict[int, dict | BaseException] = {}

    def of(kill: tuple[str, str, int]) -> dict:
        index = next(i for i, chain in enumerate(CHAINS) if kill in chain)
        if index not in done:
            try:
                done[index] = _run_chain(tmp_path_factory.mktemp(f"chain{index}") / "run", CHAINS[index])
            except BaseException as err:
                done[index] = err
                raise
        outcome = done[index]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return of


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "phase", "rank"), KILLS, ids=[f"{m}-{p}-rank{r}" for m, p, r in KILLS])
def test_kill_during_save_resumes_from_the_last_good_checkpoint(
    chains, two_rank_reference: dict[int, float], mode: str, phase: str, rank: int
) -> None:
    chain = chains((mode, phase, rank))
    kill = chain["kills"][phase]
    killed = kill["killed"]
    assert killed.returncode != 0 and killed.exitcodes[rank] == -signal.SIGKILL, killed.stderr
    good = kill["good"]
    assert kill["last_good"] == good
    assert kill["damage"] is None, kill["damage"]  # verify(good)

    assert chain["again"].returncode == 0, chain["again"].stderr
    start = kill["start"]
    assert f"resumed from {good} at step {good.name[5:]}" in start, start
    if phase != "stage":  # a kill in staging may or may not come before rank 0 creates .tmp_step_4
        skipped = "" if phase in COUNTED else f"; skipped {SKIPPED.get(phase, SKIPPED['prepare'])}"
        assert start.endswith(f"{skipped}; training to step 6"), start
    # Every launch of the chain logged the losses of the run without a fault (a resume that went wrong
    # shows in its own launch's rows, even where a later launch redid the step), and the last reached 6.
    assert all(loss == two_rank_reference[step] for step, loss in chain["rows"]), chain["rows"]
    assert {step for step, _ in chain["rows"]} == set(two_rank_reference)
    assert chain["left"] == ["latest", "step_6"]  # the debris went with the next save


def _kill_during_swap(out: str) -> None:
    """Child process: checkpoints 2 and 4, step 4 then damaged; saving step 4 again dies mid-swap."""
    job = tiny_job(out, checkpoint__keep=2)
    model, opt = build(job, SINGLE)
    ck = Checkpointer(job, SINGLE)
    ck.save(2, model, opt, {"step": 2})
    ck.save(4, model, opt, {"step": 4})
    _flip_byte(Path(out, "checkpoints", "step_4", "__0_0.distcp"))
    os.environ[ENV] = "kill_during_save:phase=swap:step=4"
    ck.save(4, model, opt, {"step": 4})


@pytest.mark.slow
def test_kill_while_replacing_a_damaged_checkpoint_keeps_the_previous_one(tmp_path: Path) -> None:
    child = mp.get_context("forkserver").Process(target=_kill_during_swap, args=(str(tmp_path),))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    root = tmp_path / "checkpoints"
    # `latest` still names step_4, now moved aside; the new step_4 never made it out of .tmp_step_4.
    assert (root / "latest").read_text() == "step_4\n" and not (root / "step_4").exists()
    assert last_good_checkpoint(root) == (
        root / "step_2",
        [
            "step_4 (latest names it, but it is missing)",
            ".tmp_step_4 (a save interrupted before it was published)",
        ],
    )
    job = tiny_job(tmp_path, checkpoint__keep=2)
    model, opt = build(job, SINGLE)
    ck = Checkpointer(job, SINGLE)
    assert ck.load(root / "step_2", model, opt) == {"step": 2}
    ck.save(4, model, opt, {"step": 4})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_4"]
    verify(root / "step_4")


DAMAGES = {
    "truncated": ("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "corrupt": ("__0_0.distcp", _flip_byte),
    "missing": ("trainer_state.pt", Path.unlink),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_latest_checkpoint_is_named_and_the_previous_one_resumed(
    tmp_path: Path, saved_run: Path, one_rank_reference: dict[int, float], damage: str
) -> None:
    out = _copy(saved_run, tmp_path)
    name, spoil = DAMAGES[damage]
    spoil(out / "checkpoints" / "step_4" / name)
    again = pretrain(0, out, *COMMON, "checkpoint.keep=2")
    assert again.returncode == 0, again.stderr
    start = _start_line(again.stdout)
    root = out / "checkpoints"
    assert (
        f"resumed from {root / 'step_2'} at step 2; skipped step_4 ({root / 'step_4' / name} is {damage}"
        in start
    )
    assert _losses(out) == one_rank_reference
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_4", "step_6"]


@pytest.mark.slow
def test_damaged_checkpoint_named_explicitly_or_as_the_last_one_stops_with_one_line(
    tmp_path: Path, saved_run: Path
) -> None:
    source = _copy(saved_run, tmp_path)
    shard = source / "checkpoints" / "step_4" / "__0_0.distcp"
    _flip_byte(shard)
    explicit = pretrain(0, tmp_path / "fresh", *COMMON, f"checkpoint.load={shard.parent}")
    assert explicit.returncode == 2
    assert explicit.stderr.startswith("pretrain: error: checkpoint ") and explicit.stderr.count("\n") == 1
    assert f"{shard} is corrupt: CRC-32" in explicit.stderr and "Traceback" not in explicit.stdout

    _flip_byte(source / "checkpoints" / "step_2" / "__0_0.distcp")
    resumed = pretrain(0, source, *COMMON)
    assert resumed.returncode == 2 and resumed.stderr.count("\n") == 1, resumed.stderr
    assert (
        f"error: no checkpoint in {source / 'checkpoints'} passes verification: step_4 ({shard} is corrupt"
        in (resumed.stderr)
    )
    assert "step_2 (" in resumed.stderr and "Traceback" not in resumed.stdout


@pytest.mark.slow
def test_full_disk_keeps_the_last_checkpoint_and_stops_or_goes_on(tmp_path: Path, saved_run: Path) -> None:
    out = _copy(saved_run, tmp_path)
    root = out / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    cause = f"not saved: no space left in {root} (rank 0: File too large writing .tmp_step_6/__0_0.distcp)"
    kept = f"its partial files are removed; kept {root / 'step_4'}"

    stop = pretrain(0, out, *COMMON, "checkpoint.on_save_error=stop", file_size_limit=FILE_SIZE_LIMIT)
    assert stop.returncode == 2 and stop.stderr.count("\n") == 1, stop.stderr
    assert stop.stderr.startswith(f"pretrain: error: checkpoint step_6 {cause}; {kept}; stopping"), (
        stop.stderr
    )
    assert "Traceback" not in stop.stdout
    assert sorted(p.name for p in root.iterdir()) == before
    verify(root / "step_4")

    go_on = pretrain(0, out, *COMMON, "train.steps=8", file_size_limit=FILE_SIZE_LIMIT)
    assert go_on.returncode == 0, go_on.stderr
    assert go_on.stderr.splitlines() == [
        f"checkpoint step_{step} {cause.replace('step_6', f'step_{step}')}; {kept}; training goes on "
        "(checkpoint.on_save_error=continue)"
        for step in (6, 8)
    ]
    assert max(_losses(out)) == 8
    assert sorted(p.name for p in root.iterdir()) == before
    verify(root / "step_4")


@pytest.mark.slow
@pytest.mark.parametrize("on_save_error", ["continue", "stop"])
def test_one_rank_out_of_space_publishes_on_no_rank(
    tmp_path: Path, two_rank_reference: dict[int, float], on_save_error: str
) -> None:
    out = tmp_path / "run"
    overrides = (*TWO_RANKS, f"checkpoint.on_save_error={on_save_error}")
    result = pretrain(2, out, *overrides, faults="disk_full:rank=1:step=4:file=__1_0.distcp")
    root = out / "checkpoints"
    message = (
        f"checkpoint step_4 not saved: no space left in {root} (rank 1: No space left on device writing "
        f".tmp_step_4/__1_0.distcp; rank 0: "
    )
    assert result.stderr.count(message) == 1, result.stderr  # rank 0 reports, for every rank
    assert "checkpoint saved: " + str(root / "step_4") not in result.stdout
    assert f"its partial files are removed; kept {root / 'step_2'}" in result.stderr
    if on_save_error == "continue":
        assert result.returncode == 0, result.stderr
        assert _losses(out) == two_rank_reference  # the failed save took nothing from training
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_6"]
    else:
        assert result.returncode != 0 and "pretrain: error: " + message in result.stderr
        assert "Traceback" not in result.stdout and "[rank" not in result.stderr  # no worker traceback
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
        verify(root / "step_2")


def test_on_save_error_takes_continue_or_stop() -> None:
    with pytest.raises(ConfigError, match="checkpoint.on_save_error must be one of continue, stop; got"):
        load(CONFIG, ["checkpoint.on_save_error=ignore"])
    job = load(CONFIG, [])
    assert job.checkpoint.on_save_error == "continue"
