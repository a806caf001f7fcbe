"""torchtitan's LLaMA-3 on one device, timed by bench_e2e.py's loop: the named peer of the e2e benchmark.

torchtitan's own trainer (torchtitan.train) needs a Hugging Face tokenizer and dataset by name, which the
GPU machine (no network) does not have; so this builds torchtitan's model and applies torchtitan's own
single-GPU recipe to it, and trains it in the same loop, on the same random tokens, as our variants:

- the model: torchtitan's llama3 Transformer (TransformerModelArgs at the job's dimensions: hidden, layers,
  heads, kv heads, vocab, rope theta 500000, its FFN rule set to give the job's FFN width), built on the meta
  device, then materialized and initialized with its own init_weights, as its trainer does. torchtitan 0.2.x
  has no weight tying, so its output projection is a separate matrix (0.26 B more parameters at 1B, same
  FLOPs);
- its parallelize_llama with its JobConfig: its activation checkpointing (mode from the config's recompute:
  none/selective/full; its selective default is per-op), its per-TransformerBlock torch.compile and compiled
  loss (compile.enable, torchtitan's recommended setting); on one GPU it applies no FSDP, and its trainer
  runs forward and loss under its maybe_enable_amp (torch.autocast to bf16 over fp32 parameters), as here;
- its attention: its default for llama3 in 0.2.x, SDPA with is_causal (flash/cuDNN/efficient per PyTorch);
- its cross_entropy_loss (sum) over the valid-token count, and torch.optim.AdamW (fused on CUDA), as its
  optimizer builder defaults to.

Nothing of torchtitan is copied: everything is imported from the installed package. torchtitan 0.3.0 needs a
nightly torch (torch.distributed.fsdp.DataParallelMeshDims, absent from torch 2.11), so this targets 0.2.x
(written against 0.2.2). Its modules import, beyond torch: tyro (+ docstring_parser), torchdata,
tokenizers and tensorboard (the last two come with transformers and torch's usual installs), and
`datasets` through torchtitan.hf_datasets, which is only used to load a dataset: without it, a stand-in
module that raises when called is registered so the model's imports succeed (datasets needs pyarrow, too
large to carry).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TitanDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0


def dims_of(model_cfg: Any) -> TitanDims:
    """Our ModelConfig's dimensions, as torchtitan's TransformerModelArgs takes them."""
    return TitanDims(
        hidden=model_cfg.hidden_size,
        layers=model_cfg.num_layers,
        heads=model_cfg.num_attention_heads,
        kv_heads=model_cfg.num_kv_heads or model_cfg.num_attention_heads,
        ffn=model_cfg.ffn_hidden_size,
        vocab=model_cfg.vocab_size,
        rope_theta=model_cfg.rope_theta,
    )


def ffn_rule(hidden: int, ffn: int) -> dict[str, Any]:
    """torchtitan's FFN width: multiple_of * ceil(int(multiplier * int(8 * hidden / 3)) / multiple_of). With
    multiple_of = ffn it is ffn whenever the product is in (0, ffn]; the multiplier brings a larger base
    under it. Returns the TransformerModelArgs fields (1B/3B: multiple_of=8192, no multiplier)."""
    base = int(2 * (4 * hidden) / 3)
    return {"multiple_of": ffn, "ffn_dim_multiplier": None if base <= ffn else ffn / base}


def stand_in_datasets() -> bool:
    """Register a `datasets` stand-in (calls raise) when the real one is absent; True if it did."""
    if importlib.util.find_spec("datasets") is not None:
        return False

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the datasets package is not installed (stand-in for torchtitan's imports)")

    mod, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    mod.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
    mod.load_dataset = absent  # type: ignore[attr-defined]
    dist.split_dataset_by_node = absent  # type: ignore[attr-defined]
    mod.distributed = dist  # type: ignore[attr-defined]
    sys.modules["datasets"], sys.modules["datasets.distributed"] = mod, dist
    return True


def build(
    dims: TitanDims, seq: int, batch: int, device: str, *, compile_model: bool, ac: str
) -> tuple[torch.nn.Module, Any, Any, str]:
    """torchtitan's model with its single-GPU recipe applied: (model, loss_fn, amp context, label)."""
    stand_in_datasets()
    import torchtitan
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama

    job = JobConfig()
    job.training.seq_len, job.training.local_batch_size = seq, batch
    job.compile.enable = compile_model
    job.activation_checkpoint.mode = ac
    job.job.dump_folder = tempfile.mkdtemp(prefix="titan_dump_")
    args = TransformerModelArgs(
        dim=dims.hidden,
        n_layers=dims.layers,
        n_heads=dims.heads,
        n_kv_heads=dims.kv_heads,
        vocab_size=dims.vocab,
        rope_theta=dims.rope_theta,
        max_seq_len=max(seq, 8192),
        **ffn_rule(dims.hidden, dims.ffn),
    )
    with torch.device("meta"):
        model = Transformer(args)
    width = model.layers["0"].feed_forward.w1.out_features
    if width != dims.ffn:
        raise ValueError(f"torchtitan's FFN came out {width} wide, not {dims.ffn}")
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = parallelize_llama(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, device)
    label = f"torchtitan {torchtitan.__version__} llama3, {args.attn_type} attention, AC {ac}"
    return model, build_cross_entropy_loss(job), amp, label


def run(
    dims: TitanDims,
    seq: int,
    batch: int,
    device: str,
    *,
    lr: float,
    compile_model: bool,
    ac: str,
    timed: Callable[[Callable[[], torch.Tensor]], tuple[list[float], float, Any]],
) -> dict[str, Any]:
    """Build torchtitan's model and hand one training step on a micro-batch of random tokens to `timed`
    (bench_e2e's loop: losses, median step seconds, profile); the row's figures."""
    model, loss_fn, amp, label = build(dims, seq, batch, device, compile_model=compile_model, ac=ac)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=device == "cuda"
    )
    tokens = torch.randint(0, dims.vocab, (batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        with amp:  # as torchtitan's train step: forward and loss under its AMP context, backward outside
            pred = model(inputs)
            loss = loss_fn(pred, labels) / labels.numel()
        del pred
        loss.backward()
        optimizer.step()
        return loss

    losses, step_s, breakdown = timed(step)
    return {
        "peer": label,
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "median_step_s": step_s,
        "losses": losses,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "profile": breakdown,
    }
