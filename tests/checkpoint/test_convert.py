"""Offline conversions. Reference: the transformers model's own safetensors (HF -> llmtrain -> HF is bitwise)
and the source checkpoint's tensors (re-chunking changes no value)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.checkpoint import CheckpointError
from llmtrain.checkpoint.convert import describe, from_hf, info, read_full, reshard, to_hf
from llmtrain.models.hf import read_hf
from tests.models.hf_models import hf_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# (arch, transformers config index, tp): every mixture of experts too (stacked experts in the checkpoint, one
# tensor per expert in transformers'; ERNIE's score bias, DeepSeek-V3's as a buffer). DeepSeek-V3's latent
# attention has no TP yet, so its checkpoint is chunked over pp and dp.
ROUND_TRIPS = [
    ("gpt", 0, 2), ("llama", 0, 2), ("ernie", 0, 2),
    ("mixtral", 0, 2), ("qwen3_moe", 0, 2), ("ernie_moe", 0, 2), ("deepseek_v3", 0, 1),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "index", "tp"), ROUND_TRIPS)
def test_hf_to_sharded_checkpoint_to_hf_is_bitwise(tmp_path: Path, arch: str, index: int, tp: int) -> None:
    ref = hf_model(arch, index)
    ref.save_pretrained(tmp_path / "hf")
    step = from_hf(tmp_path / "hf", tmp_path / "run", tp=tp, pp=2, dp=4 // (2 * tp))
    assert step == tmp_path / "run" / "checkpoints" / "step_0"
    d = info(tmp_path / "run")
    assert d["step"] == 0 and d["layout"]["tp"] == tp and d["world_size"] == 4
    if tp == 2:
        assert d["tensors"]["model.layers.0.attn.q_proj.weight"]["chunks"] == 2  # one per TP rank
    assert d["tensors"]["model.final_norm.weight"]["chunks"] == 1  # replicated: one writer
    # Split into several files with an index, as transformers does for large models.
    to_hf(tmp_path / "run", tmp_path / "back", max_shard_bytes=200_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    _, original = read_hf(tmp_path / "hf")
    _, back = read_hf(tmp_path / "back")
    original = {
        k: v for k, v in original.items() if not (ref.config.tie_word_embeddings and k == "lm_head.weight")
    }
    assert sorted(back) == sorted(original)
    for name, value in original.items():
        assert torch.equal(back[name], value), name


def test_reshard_inspect_and_errors(tmp_path: Path) -> None:
    from llmtrain.checkpoint import Checkpointer
    from llmtrain.parallel import Topology
    from tests.checkpoint._util import build, tiny_job, train

    job = tiny_job(tmp_path / "run")
    topo = Topology.single()
    model, opt = build(job, topo)
    train(job, topo, model, opt, 0, 1)
    Checkpointer(job, topo).save(1, model, opt, {"step": 1, "consumed_samples": 4})
    out = reshard(tmp_path / "run", tmp_path / "resharded", tp=2, pp=2, dp=1)
    before, after = read_full(tmp_path / "run"), read_full(out)
    assert sorted(before) == sorted(after) and any(k.startswith("optim.") for k in after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (
        info(out)["tensors"]["model.layers.1.mlp.gate_up_proj.weight"]["chunks"] == 4
    )  # gate and up per rank
    text = describe(out)
    assert (
        "step 1, written by 4 ranks (tp=2 pp=2 dp=1" in text
        and "optim.layers.0.attn.q_proj.weight.exp_avg" in text
    )
    with pytest.raises(CheckpointError, match="parallel.tp=3 does not divide model.num_attention_heads=4"):
        reshard(tmp_path / "run", tmp_path / "bad", tp=3)
    with pytest.raises(CheckpointError, match="is neither a training checkpoint nor an llmtrain model"):
        to_hf(tmp_path, tmp_path / "hf")
    assert load_file  # imported for the HF test above
