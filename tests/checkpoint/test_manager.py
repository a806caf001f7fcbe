"""Single-process Checkpointer: exact resume, publishing, pruning, async, and every bad-input case.

References: the uninterrupted run (exact resume must reproduce its losses bit for bit) and the tensors as
they were when saved.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint import Checkpointer, CheckpointError
from llmtrain.parallel import Topology
from tests.checkpoint._util import build, tiny_job, train

SINGLE = Topology.single()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(tmp_path: Path, steps: int = 2, **overrides: object) -> tuple[object, torch.nn.Module, object]:
    job = tiny_job(tmp_path, **overrides)
    model, opt = build(job, SINGLE)
    train(job, SINGLE, model, opt, 0, steps)
    return job, model, opt


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_resume_is_bitwise(tmp_path: Path, precision: str) -> None:
    job, model, opt = _trained(tmp_path, train__precision=precision)
    ck = Checkpointer(job, SINGLE)
    ck.save(2, model, opt, {"step": 2, "consumed_samples": 8})
    reference = train(job, SINGLE, model, opt, 2, 4)  # dropout draws from the RNG saved above

    fresh, fresh_opt = build(job, SINGLE)
    torch.manual_seed(12345)  # a different RNG state: load must restore the saved one
    path = ck.resume_path()
    assert path == tmp_path / "checkpoints" / "step_2"
    extra = ck.load(path, fresh, fresh_opt)
    assert extra == {"step": 2, "consumed_samples": 8}
    assert train(job, SINGLE, fresh, fresh_opt, 2, 4) == reference
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_plain_module_and_torch_adamw(tmp_path: Path) -> None:
    job = tiny_job(tmp_path)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.3)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            loss = net(torch.randn(3, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    steps(2)
    ck = Checkpointer(job)
    ck.save(2, net, opt, {})
    reference = steps(2)
    torch.manual_seed(1)
    net.apply(lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None)
    opt.state.clear()
    opt.param_groups[0]["weight_decay"] = 0.0  # restored from the checkpoint
    ck.load(ck.resume_path(), net, opt)
    assert opt.param_groups[0]["weight_decay"] == 0.3
    assert steps(2) == reference


def test_keep_latest_and_load_elsewhere(tmp_path: Path) -> None:
    job, model, opt = _trained(tmp_path / "run", steps=1, checkpoint__keep=2)
    ck = Checkpointer(job, SINGLE)
    for step in (1, 2, 3):
        ck.save(step, model, opt, {"step": step})
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    assert (root / "latest").read_text().strip() == "step_3"
    manifest = json.loads((root / "step_3" / "manifest.json").read_text())
    assert {".metadata", "meta.json", "trainer_state.pt", "rng/rank_00000.pt", "__0_0.distcp"} <= set(
        manifest["files"]
    )

    # checkpoint.load in a new output dir starts from the given checkpoint; resume=False ignores latest.
    other = tiny_job(tmp_path / "new", checkpoint__load=str(root / "step_2"))
    assert Checkpointer(other, SINGLE).resume_path() == root / "step_2"
    assert Checkpointer(tiny_job(tmp_path / "run", checkpoint__resume=False), SINGLE).resume_path() is None
    assert Checkpointer(tiny_job(tmp_path / "empty"), SINGLE).resume_path() is None
    # Saving a step again (final step after a resume) replaces it.
    ck.save(3, model, opt, {"step": 33})
    assert ck.load(root, model, opt)["step"] == 33


def test_async_save_writes_the_state_at_save_time(tmp_path: Path) -> None:
    job, model, opt = _trained(tmp_path, checkpoint__async_save=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(job, SINGLE)
    ck.save(2, model, opt, {"step": 2})
    train(job, SINGLE, model, opt, 2, 3)  # changes the weights while the save may still run
    ck.wait()
    ck.load(ck.resume_path(), model, opt)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    ck.close()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[object, torch.nn.Module, object, Path]:
    job, model, opt = _trained(tmp_path, steps=1)
    Checkpointer(job, SINGLE).save(1, model, opt, {"step": 1})
    return job, model, opt, tmp_path / "checkpoints" / "step_1"


def _load_error(job: object, model: torch.nn.Module, opt: object, path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        Checkpointer(job, SINGLE).load(path, model, opt)
    return str(info.value)


def test_missing_truncated_and_corrupt_files(saved: tuple) -> None:
    job, model, opt, path = saved
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    assert "__0_0.distcp is truncated" in _load_error(job, model, opt, path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    assert "__0_0.distcp is corrupt" in _load_error(job, model, opt, path)
    shard.unlink()
    assert "__0_0.distcp is missing" in _load_error(job, model, opt, path)
    (path / "manifest.json").unlink()
    assert "incomplete checkpoint" in _load_error(job, model, opt, path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 64, "model.hidden_size=32, this job has model.hidden_size=64"),
        ("arch", "ernie", "model.arch=llama, this job has model.arch=ernie"),
        ("num_kv_heads", 4, "model.num_kv_heads=2, this job has model.num_kv_heads=4"),
    ],
)
def test_other_model_is_named(saved: tuple, tmp_path: Path, field: str, value: object, message: str) -> None:
    _, _, _, path = saved
    other = tiny_job(tmp_path / "other", **{f"model__{field}": value})
    model, opt = build(other, SINGLE)
    assert message in _load_error(other, model, opt, path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_experts", 6, "model.num_experts=4, this job has model.num_experts=6; set model.num_experts=4"),
        (
            "moe_ffn_hidden_size",
            24,
            "model.moe_ffn_hidden_size=16, this job has model.moe_ffn_hidden_size=24",
        ),
        ("num_shared_experts", 2, "model.num_shared_experts=1, this job has model.num_shared_experts=2"),
        ("dense_layers", [0], "holds experts in layers [0, 1], this job in layers [1]; set"),
    ],
)
def test_other_mixture_of_experts_is_named(tmp_path: Path, field: str, value: object, message: str) -> None:
    """Without the field check the load would fail on the first expert tensor's shape, naming no field."""
    moe = dict(model__arch="ernie_moe", model__num_experts=4, model__moe_ffn_hidden_size=16)
    job = tiny_job(tmp_path / "moe", **moe, model__num_shared_experts=1)
    model, opt = build(job, SINGLE)
    Checkpointer(job, SINGLE).save(0, model, opt, {"step": 0})
    other = tiny_job(tmp_path / "other", **{**moe, "model__num_shared_experts": 1, f"model__{field}": value})
    model, opt = build(other, SINGLE)
    assert message in _load_error(other, model, opt, tmp_path / "moe" / "checkpoints")


def test_other_tensor_shape_is_named(saved: tuple) -> None:
    job, _, _, path = saved
    net = torch.nn.Linear(3, 3)  # same config, other module: the tensor check names it
    assert "has no tensor weight" in _load_error(job, net, None, path)


def test_latest_pointing_nowhere(saved: tuple, tmp_path: Path) -> None:
    job, model, opt, _ = saved
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(CheckpointError, match="names step_9, which is not a complete checkpoint"):
        Checkpointer(job, SINGLE).resume_path()


def _crash_and_disk_full(out: str) -> None:
    """Child process: save step 1; hit a file-size limit in step 2; die in the middle of step 3."""
    import os
    import resource
    import signal

    import llmtrain.checkpoint.storage as storage

    job = tiny_job(out, checkpoint__on_save_error="stop")
    model, opt = build(job, SINGLE)
    ck = Checkpointer(job, SINGLE)
    ck.save(1, model, opt, {"step": 1})
    # A file-size limit makes writes fail exactly as a full disk does (an OSError from write()).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        ck.save(2, model, opt, {"step": 2})
        message = "no error"
    except CheckpointError as err:
        message = str(err)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    Path(out, "disk_full_error.txt").write_text(message)
    # Die in the middle of writing the tensor file of step 3.
    write = storage._RecordingStream.write

    def dying_write(self: object, data: bytes) -> int:
        write(self, data)
        os._exit(3)

    storage._RecordingStream.write = dying_write
    ck.save(3, model, opt, {"step": 3})


@pytest.mark.slow
def test_disk_full_and_crash_mid_save_keep_the_last_good_checkpoint(tmp_path: Path) -> None:
    child = mp.get_context("spawn").Process(target=_crash_and_disk_full, args=(str(tmp_path),))
    child.start()
    child.join(120)
    assert child.exitcode == 3
    message = (tmp_path / "disk_full_error.txt").read_text()
    assert message.startswith("checkpoint step_2 not saved: no space left in") and "__0_0.distcp" in message
    assert f"kept {tmp_path / 'checkpoints' / 'step_1'}" in message
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_1"
    assert not (root / "step_2").exists() and not (root / "step_3").exists()
    assert (root / ".tmp_step_3" / "__0_0.distcp").exists()  # the crashed save, invisible to loading
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        Checkpointer(tiny_job(tmp_path), SINGLE).load(
            root / ".tmp_step_3", *build(tiny_job(tmp_path), SINGLE)
        )
    job = tiny_job(tmp_path)
    model, opt = build(job, SINGLE)
    ck = Checkpointer(job, SINGLE)
    assert ck.load(ck.resume_path(), model, opt) == {"step": 1}
    ck.save(4, model, opt, {"step": 4})  # the next save clears the debris
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_4"]
