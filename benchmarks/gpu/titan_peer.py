"""torchtitan's LLaMA-3 on one device, timed by bench_e2e.py's loop: the named peer of the e2e benchmark.

torchtitan's own trainer (torchtitan.train) needs a Hugging Face tokenizer and dataset by name, which the
GPU machine (no network) does not have; so this builds torchtitan's model and applies torchtitan's own
single-GPU recipe to it, and trains it in the same loop, on the same random tokens, as our variants:

- the model: torchtitan's Llama3Model, its "1B"/"3B" flavor when the job's dimensions are that flavor's
  (configs/llama-1b.yaml and llama-3b.yaml are), else the same builder at the job's dimensions (dry run);
  built on the meta device, then materialized and initialized with its own init_weights, as its trainer does;
- its parallelize_llama: activation checkpointing (its SelectiveAC, as its llama3 8B recipe, or none),
  torch.compile of each TransformerBlock (its apply_compile) and FSDP2 with shard degree 1 for bf16 mixed
  precision (fp32 parameters and optimizer state, bf16 compute), on a one-rank process group;
- its default attention (FlexAttention with the causal + packed-document block mask its dataloader implies;
  one document per sequence here);
- its loss (CrossEntropyLoss, sum over tokens / valid tokens, compiled with the model when compile is on)
  and torch.optim.AdamW (fused on CUDA), as its default_adamw builds.

Nothing of torchtitan is copied: everything is imported from the installed package (0.3.0 is what this was
written against; its imports need the pure-Python wheels spmd_types, tyro, docstring_parser and typeguard).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

# torchtitan's flavors our configs mirror: (hidden, layers, heads, kv heads, ffn, vocab) -> flavor name.
FLAVORS = {
    (2048, 16, 32, 8, 8192, 128256): "1B",
    (3072, 28, 24, 8, 8192, 128256): "3B",
}


@dataclass
class TitanDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


def dims_of(model_cfg: Any) -> TitanDims:
    """Our ModelConfig's dimensions, as torchtitan's builders take them."""
    return TitanDims(
        hidden=model_cfg.hidden_size,
        layers=model_cfg.num_layers,
        heads=model_cfg.num_attention_heads,
        kv_heads=model_cfg.num_kv_heads or model_cfg.num_attention_heads,
        ffn=model_cfg.ffn_hidden_size,
        vocab=model_cfg.vocab_size,
    )


def flavor_of(dims: TitanDims) -> str | None:
    key = (dims.hidden, dims.layers, dims.heads, dims.kv_heads, dims.ffn, dims.vocab)
    return FLAVORS.get(key)


def titan_model_config(dims: TitanDims, attn_backend: str) -> tuple[Any, str]:
    """torchtitan's Llama3Model.Config for these dimensions: its named flavor where one matches, else its
    flavor builder's pieces at these dimensions (the dry run's tiny model). Returns (config, label)."""
    import torchtitan.models.llama3 as tl3

    flavor = flavor_of(dims)
    backend = "flex" if attn_backend == "sdpa" else attn_backend
    if flavor is not None:
        config, label = tl3.llama3_configs[flavor](attn_backend=backend), flavor
    else:
        config, label = _custom_config(tl3, dims, backend), f"at {dims}"
    if attn_backend == "sdpa":
        # torchtitan's ScaledDotProductAttention (cuDNN, then flash, then math; causal, no block mask):
        # the same attention as its flex default for one document per sequence.
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config, f"{label}, {attn_backend} attention"


def _custom_config(tl3: Any, dims: TitanDims, attn_backend: str) -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    init_norm = {"weight": torch.nn.init.ones_}
    init_emb = {"weight": lambda w: torch.nn.init.normal_(w, std=1.0)}
    config = tl3.Llama3Model.Config(
        dim=dims.hidden,
        vocab_size=dims.vocab,
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=dims.vocab, embedding_dim=dims.hidden, param_init=init_emb
        ),
        norm=RMSNorm.Config(normalized_shape=dims.hidden, param_init=init_norm),
        lm_head=Linear.Config(in_features=dims.hidden, out_features=dims.vocab),
        layers=tl3._build_llama3_layers(
            n_layers=dims.layers,
            dim=dims.hidden,
            n_heads=dims.heads,
            n_kv_heads=dims.kv_heads,
            hidden_dim=dims.ffn,
            rope=ComplexRoPE.Config(
                dim=dims.hidden // dims.heads, max_seq_len=131072, theta=500000, scaling="llama"
            ),
            attn_backend=attn_backend,
        ),
    )
    return config


def _init_one_rank(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = tempfile.mkstemp(prefix="titan_pg_")[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0) if device == "cuda" else None,
    )


def build(
    dims: TitanDims, seq: int, device: str, *, compile_model: bool, ac: str, attn_backend: str
) -> tuple[torch.nn.Module, Any, str]:
    """torchtitan's model with its single-GPU recipe applied: (model, loss_fn, flavor label)."""
    import torchtitan
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    _init_one_rank(device)
    if device == "cpu":  # torchtitan picks "cuda" for its meshes when no accelerator is found (dry run)
        import torchtitan.distributed.parallel_dims as titan_parallel_dims

        titan_parallel_dims.device_type = "cpu"
    config, label = titan_model_config(dims, attn_backend)
    parallelism = ParallelismConfig()
    # (its update_from_config imports torchtitan.trainer, hence torchdata; it only resizes RoPE caches for
    # seq_len > 131072 and sets tensor-parallel sharding, neither of which applies here)
    with torch.device("meta"):
        model = config.build()
    parallel_dims = ParallelDims.from_config(parallelism, world_size=1)
    parallel_dims.build_mesh()
    ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    training = TrainingConfig(local_batch_size=1, seq_len=seq)
    compile_config = CompileConfig(enable=compile_model)
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=tempfile.mkdtemp(prefix="titan_dump_"),
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss.Config().build()
    if compile_model and "loss" in compile_config.components:
        loss_fn = torch.compile(loss_fn, backend=compile_config.backend)
    return model, loss_fn, f"torchtitan {torchtitan.__version__} {label}"


def run(
    dims: TitanDims,
    seq: int,
    batch: int,
    steps: int,
    warmup: int,
    device: str,
    *,
    lr: float,
    compile_model: bool,
    ac: str,
    attn_backend: str,
) -> dict[str, Any]:
    """Train `steps` steps of one micro-batch of random tokens; the timed steps' figures (as run_variant)."""
    model, loss_fn, label = build(
        dims, seq, device, compile_model=compile_model, ac=ac, attn_backend=attn_backend
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=device == "cuda"
    )
    tokens = torch.randint(0, dims.vocab, (batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # One document per sequence: positions 0..seq-1 on every row, as torchtitan's dataloader emits them.
    positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()
    masks = None if attn_backend == "sdpa" else model.get_attention_masks(positions)
    valid = torch.tensor(labels.numel(), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        pred = model(inputs, positions=positions, attention_masks=masks)
        loss = loss_fn(pred, labels, valid)
        loss = loss[0] if isinstance(loss, tuple) else loss
        del pred
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    return {
        "peer": label,
        "params_b": params / 1e9,
        "median_step_s": sorted(times)[len(times) // 2],
        "losses": losses,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }
