"""parallel.engine=deepspeed: DeepSpeed's ZeRO engine (with CPU offload) behind the trainer's optimizer
interface trains like one process and like llmtrain's own engine; bad combinations fail at config time.

The reference is the one of tests/parallel/test_equivalence.py: plain torch (AdamW, clip_grad_norm_) in
float64, with the bounds an fp32 run must stay within (tests/parallel/_reference.py). DeepSpeedCPUAdam
computes the same AdamW update as torch's in another order of fp32 operations (bias corrections folded
into the step size and into sqrt(v)): each update differs by a few fp32 roundings of the update itself,
which the bound's per-step rounding term 3u(|theta| + |update|) covers, so DeepSpeed must meet the same
bounds as llmtrain's engine and torch's own fp32 run. Its C++ ops compile once into the shared
TORCH_EXTENSIONS_DIR (see conftest's deepspeed_extensions fixture).
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from llmtrain.config import ConfigError, load
from llmtrain.parallel import Topology
from tests.parallel._dist import SpawnedCases, batches, call, parallel_run, tiny_job
from tests.parallel._reference import Reference, torch_reference

STEPS = 4
LR = 1e-3
# (zero_stage, offload): ZeRO-2 and ZeRO-3 with the optimizer on the CPU (DeepSpeedCPUAdam), ZeRO-3 with
# the parameters there too, and ZeRO-2 with torch's AdamW inside DeepSpeed (no offload).
DEEPSPEED_LAYOUTS = [(2, "optimizer"), (3, "optimizer"), (3, "optimizer+params"), (2, "none")]

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="pip install 'llmtrain[deepspeed]'"
)


def test_missing_package_is_a_one_line_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        load(None, ["parallel.engine=deepspeed", "parallel.zero_stage=2"])
    message = str(err.value)
    assert "\n" not in message
    assert "pip install 'llmtrain[deepspeed]'" in message and "parallel.engine" in message


@needs_deepspeed
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=2"], "not tp=2 pp=1; use tp=1 pp=1 with every process in dp"),
        (["parallel.pp=2"], "not tp=1 pp=2; use tp=1 pp=1 with every process in dp"),
        (["parallel.zero_stage=0"], "set parallel.zero_stage to 1, 2 or 3"),
        (["parallel.zero_stage=2", "parallel.offload=optimizer+params"], "needs parallel.zero_stage=3"),
        (["parallel.zero_stage=2", "train.precision=fp16"], "use bf16 or parallel.engine=llmtrain"),
        (["parallel.zero_stage=2", "train.precision=fp8"], "wired into llmtrain's engine only"),
        (["parallel.zero_stage=3", "parallel.dp_shard=2"], "hybrid sharding. is FSDP2's"),
    ],
)
def test_unsupported_deepspeed_layouts_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load(None, ["parallel.engine=deepspeed", *overrides])


NVME = ["parallel.engine=deepspeed", "parallel.zero_stage=3", "parallel.offload=optimizer+params"]


@needs_deepspeed
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.nvme_path=/nvme"], "read only with parallel.offload_device=nvme"),
        (["parallel.offload_device=nvme", "parallel.nvme_path=/nvme"], "set parallel.engine=deepspeed and"),
        (
            [
                *NVME,
                "parallel.zero_stage=2",
                "parallel.offload=optimizer",
                "parallel.offload_device=nvme",
                "parallel.nvme_path=/nvme",
            ],
            "needs parallel.zero_stage=3",
        ),  # fmt: skip
        ([*NVME, "parallel.offload_device=nvme"], "needs parallel.nvme_path"),
    ],
)
def test_bad_nvme_offload_settings_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load(None, overrides)


def _engine_rules():
    """llmtrain.config.engine_rules, whose nvme_problem asks async_io_available."""
    return importlib.import_module("llmtrain.config.engine_rules")


@needs_deepspeed
def test_nvme_offload_without_libaio_is_a_one_line_config_error(monkeypatch):
    """DeepSpeed's async_io op needs libaio (this machine has none); the error names the package."""
    monkeypatch.setattr(_engine_rules(), "async_io_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        load(None, [*NVME, "parallel.offload_device=nvme", "parallel.nvme_path=/nvme"])
    message = str(err.value)
    assert "\n" not in message and "apt install libaio-dev" in message, message


@needs_deepspeed
def test_nvme_offload_maps_to_deepspeed_swap_files(monkeypatch):
    from llmtrain.parallel.deepspeed_engine import deepspeed_config

    monkeypatch.setattr(_engine_rules(), "async_io_available", lambda: True)
    job = load(None, [*NVME, "parallel.offload_device=nvme", "parallel.nvme_path=/nvme"])
    zero = deepspeed_config(job, 1)["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        assert zero[section]["device"] == "nvme" and zero[section]["nvme_path"] == "/nvme", zero


def test_offload_and_high_zero_stages_need_deepspeed():
    with pytest.raises(ConfigError, match="parallel.offload=optimizer needs parallel.engine=deepspeed"):
        load(None, ["parallel.offload=optimizer"])


def _deepspeed_run(job, topo: Topology, data: list[torch.Tensor], skip: tuple[int, ...] = ()) -> dict:
    """DeepSpeed on `topo` over the global batches `data`, driven as the trainer drives it (the runner,
    prepare, then apply at constant LR or, for the 0-based steps in `skip`, skip); losses (mean over DP)
    and gradient norms of the applied steps, the full weights at the end, and DeepSpeed's skip count."""
    import deepspeed
    import torch.distributed as dist

    from llmtrain import models
    from llmtrain.parallel.deepspeed_engine import build_deepspeed, grad_sync
    from llmtrain.training.profiling import StepTimer
    from llmtrain.training.trainer import LocalStepRunner

    torch.manual_seed(job.train.seed)
    engine, optimizer = build_deepspeed(models.build(job.model), topo, job)
    runner = LocalStepRunner(engine, optimizer, job.train.micro_batch_size, grad_sync)
    timer = StepTimer(False)
    losses, norms = [], []
    for step, batch in enumerate(data):
        loss = runner.train_step(batch.chunk(topo.dp)[topo.dp_rank], timer).double() / topo.dp
        dist.all_reduce(loss)
        norm = optimizer.prepare()
        if step in skip:
            optimizer.skip(norm, overflow=False)
            continue
        losses.append(loss.item())
        norms.append(optimizer.apply(LR, norm).grad_norm)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=job.parallel.zero_stage == 3):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "state": state, "skipped": engine.skipped_steps}


def _worst_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _bound_fraction(reference: Reference, state: dict[str, torch.Tensor]) -> float:
    """The largest weight error of a run as a fraction of the reference's fp32 bound for it."""
    assert reference.weight_bounds is not None
    return max(
        ((state[k].double() - want).abs() / reference.weight_bounds[k]).nan_to_num(0.0).max().item()
        for k, want in reference.state.items()
    )


def _equivalence(rank: int, world: int) -> tuple[list[str], list[str]]:
    job = tiny_job("llama", dp=world, zero_stage=1)
    data = batches(job, STEPS)
    ours = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
    reference = torch_reference(job, data, LR) if rank == 0 else None
    failures = []
    if rank == 0:
        failures += reference.check("llmtrain zero1", ours["losses"], ours["grad_norms"], ours["state"])
    gaps = []
    for zero_stage, offload in DEEPSPEED_LAYOUTS:
        job = tiny_job("llama", dp=world, zero_stage=zero_stage)
        job.parallel.engine, job.parallel.offload = "deepspeed", offload
        run = _deepspeed_run(job, Topology(job.parallel, world, rank), data)
        if rank != 0:
            continue
        name = f"deepspeed zero{zero_stage} offload={offload}"
        failures += reference.check(name, run["losses"], run["grad_norms"], run["state"])
        gaps.append(
            f"{name}: worst relative gap to llmtrain: loss {_worst_gap(run['losses'], ours['losses']):.2e}, "
            f"grad norm {_worst_gap(run['grad_norms'], ours['grad_norms']):.2e}; weights at "
            f"{_bound_fraction(reference, run['state']):.2f} of the float64 bound (llmtrain "
            f"{_bound_fraction(reference, ours['state']):.2f})"
        )
    return failures, gaps


@pytest.fixture(scope="module")
def deepspeed_runs(deepspeed_extensions, tmp_path_factory) -> SpawnedCases:
    """The in-process DeepSpeed runs of this module as cases of one 2-process gloo group: each process
    imports torch and DeepSpeed once (~10 CPU-s a process) for the equivalence, skipped-step and (where
    libaio lets the async_io op build) NVMe checks, whose tests assert on the recorded failures."""
    cases = {"equivalence": (2, (_equivalence,)), "skipping": (2, (_skipping,))}
    if _engine_rules().async_io_available():
        cases["nvme"] = (2, (_nvme_equivalence, str(tmp_path_factory.mktemp("nvme"))))
    return SpawnedCases(call, cases)


@needs_deepspeed
@pytest.mark.slow
def test_deepspeed_offload_trains_like_one_process(deepspeed_runs):
    """fp32, dp=2, 4 steps with 2 micro-batches each and clipping: every DeepSpeed layout's losses,
    gradient norms and final weights lie within the float64 reference's fp32 bounds, like llmtrain's."""
    failures, gaps = deepspeed_runs("equivalence")[0]
    print("\n".join(gaps))
    assert not failures, "\n".join(failures)


def _nvme_equivalence(rank: int, world: int, nvme_path: str) -> list[str]:
    job = tiny_job("gpt", dp=world, zero_stage=3)
    data = batches(job, STEPS)
    reference = torch_reference(job, data, LR) if rank == 0 else None
    p = job.parallel
    p.engine, p.offload, p.offload_device, p.nvme_path = "deepspeed", "optimizer+params", "nvme", nvme_path
    run = _deepspeed_run(job, Topology(p, world, rank), data)
    if rank != 0:
        return []
    return reference.check("deepspeed zero3 nvme", run["losses"], run["grad_norms"], run["state"])


@needs_deepspeed
@pytest.mark.slow
def test_nvme_offload_trains_like_one_process(deepspeed_runs):
    """Optimizer and parameters swapped to files under nvme_path train within the same float64 bounds as
    the CPU-offloaded and non-offloaded runs (test_deepspeed_offload_trains_like_one_process). Skipped
    where DeepSpeed's async_io op cannot build (no libaio), which config validation refuses anyway."""
    if "nvme" not in deepspeed_runs.cases:
        pytest.skip("DeepSpeed's async_io op needs libaio: apt install libaio-dev")
    failures = deepspeed_runs("nvme")[0]
    assert not failures, "\n".join(failures)


def _skipping(rank: int, world: int) -> list[str]:
    data = batches(tiny_job("gpt"), 3)
    kept = [data[0], data[2]]
    failures = []
    reference = torch_reference(tiny_job("gpt"), kept, LR) if rank == 0 else None
    for zero_stage, offload in ((2, "optimizer"), (3, "optimizer+params")):
        job = tiny_job("gpt", dp=world, zero_stage=zero_stage)
        job.parallel.engine, job.parallel.offload = "deepspeed", offload
        run = _deepspeed_run(job, Topology(job.parallel, world, rank), data, skip=(1,))
        if rank == 0:
            name = f"zero{zero_stage} offload={offload} skipping step 2"
            failures += reference.check(name, run["losses"], run["grad_norms"], run["state"])
            if run["skipped"] != 1:
                failures.append(f"{name}: DeepSpeed counted {run['skipped']} skipped steps, not 1")
    return failures


@needs_deepspeed
@pytest.mark.slow
def test_skipped_step_changes_nothing(deepspeed_runs):
    """A step the trainer skips leaves weights and Adam's moments as they were: the run over batches
    1, 2, 3 skipping 2 equals the reference over batches 1 and 3 (an applied or half-applied update would
    move the weights by ~lr, against bounds of ~1e-9)."""
    failures = deepspeed_runs("skipping")[0]
    assert not failures, "\n".join(failures)


def _step_losses(out) -> dict[int, float]:
    from llmtrain.training.metrics_file import latest_per_step, read_rows

    return {r["step"]: r["loss"] for r in latest_per_step(read_rows(out / "metrics.jsonl")) if "loss" in r}


@needs_deepspeed
@pytest.mark.slow
def test_deepspeed_checkpoint_resumes_on_llmtrain_and_deepspeed(tmp_path, deepspeed_extensions):
    """tools/pretrain.py as torchrun starts its ranks, dp=2, fp32: DeepSpeed ZeRO-2 with CPU Adam trains 3
    steps and saves (in llmtrain's layout-free format); llmtrain's ZeRO-1, and DeepSpeed's ZeRO-3 with
    optimizer and parameters on the CPU, each resume from that checkpoint to step 6 (the trainer restores the
    step, the lr schedule and the data position). Every step's loss equals one llmtrain run of 6 steps on
    one process within 1e-4 relative (the issue's bound for fp32 layouts; the engines and dp=2 against one
    process differ by ~1e-7 here and in test_deepspeed_offload_trains_like_one_process, and a checkpoint
    that lost Adam's hyper-parameters missed by 1e-2). The launches' ranks are forked with torchrun's
    environment (tests.checkpoint._ranks): the tool's run, save and resume are under test, not torchrun's
    launcher (no restart happens), so neither it nor an interpreter per rank is started. The reference is
    one process rather than a launch of dp=2, run in this process: the same global batches, so the same
    losses up to fp32 summation order, and a reference made without DP's machinery at all."""
    from tests.checkpoint._ranks import tiny_pretrain
    from tests.training._runs import train_here

    # A constant lr, so a run of 3 steps follows the same schedule as one of 6.
    common = ["train.lr_decay=constant", "train.warmup_steps=0", "train.eval_interval=0"]
    common.append("logging.interval=1")
    deepspeed = ["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.offload=optimizer"]
    llmtrain = ["parallel.zero_stage=1", "train.steps=6"]
    train_here(tmp_path / "straight", *common, "train.steps=6")  # the reference's launch is not under test
    first = tiny_pretrain(2, tmp_path / "ds", *common, *deepspeed, "train.steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    (saved,) = (tmp_path / "ds").rglob("step_3")
    second = tiny_pretrain(2, tmp_path / "resumed", *common, *llmtrain, f"checkpoint.load={saved}")
    assert second.returncode == 0, second.stderr[-3000:]
    zero3 = ["parallel.engine=deepspeed", "parallel.zero_stage=3", "parallel.offload=optimizer+params"]
    third = tiny_pretrain(
        2, tmp_path / "ds_resumed", *common, *zero3, "train.steps=6", f"checkpoint.load={saved}"
    )
    assert third.returncode == 0, third.stderr[-3000:]
    want = _step_losses(tmp_path / "straight")
    for resumed in ("resumed", "ds_resumed"):
        assert sorted(_step_losses(tmp_path / resumed)) == [4, 5, 6]  # it resumed rather than restarted
        got = {**_step_losses(tmp_path / "ds"), **_step_losses(tmp_path / resumed)}
        assert sorted(got) == sorted(want) == list(range(1, 7))
        gaps = {step: abs(got[step] - want[step]) / want[step] for step in want}
        worst = max(gaps.values())
        print(f"worst relative loss gap, DeepSpeed 3 + {resumed} 3 steps vs llmtrain 6: {worst:.2e}")
        assert worst <= 1e-4, (resumed, gaps)
