"""Training steps per second of llmtrain's models against transformers' models of the same config.

Both models get the same weights, dtype (fp32), thread count, batch and AdamW optimizer; one step is
forward + loss + backward + AdamW step. Measurements alternate between the two models (and which goes
first) over several repeats, and the median repeat is reported.

  python benchmarks/bench_model.py                       # gpt, llama, ernie at the default small size
  python benchmarks/bench_model.py --arch llama --hidden 512 --layers 8 --seq 512 --threads 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from llmtrain.config import ModelConfig
from llmtrain.models import CausalLM, build, to_hf_config
from llmtrain.models.hf import llmtrain_to_hf_state, model_state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags: model size, batch and measurement counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt,llama,ernie", help="comma-separated architectures")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads of llama and ernie (gpt has MHA)")
    p.add_argument("--ffn", type=int, default=None, help="MLP width; default: the architecture's")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before measuring")
    p.add_argument("--repeats", type=int, default=5, help="alternating measurements per model")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both models")
    return p.parse_args(argv)


def model_pair(cfg: ModelConfig) -> tuple[CausalLM, torch.nn.Module]:
    """Our model and the transformers model with identical weights (SDPA attention, no dropout)."""
    ours = build(cfg).train()
    hf_dict = to_hf_config(cfg)
    hf_config = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").train()
    missing, unexpected = ref.load_state_dict(llmtrain_to_hf_state(cfg, model_state(ours)), strict=False)
    # A tied lm_head is not in the saved state; transformers re-ties it to the embedding.
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return ours, ref


def step_fn(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> Callable[[], float]:
    """One training step (forward, loss, backward, AdamW) of `model` on a fixed batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if hf:
            loss = model(input_ids=ids, labels=ids).loss  # transformers shifts inside; same token count
        else:
            loss = model(inputs, labels=targets)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def measure(step: Callable[[], float], steps: int) -> tuple[float, float]:
    """Steps per second of wall-clock time and of this process's CPU time over `steps` consecutive steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)


def bench(arch: str, args: argparse.Namespace) -> tuple[int, dict[str, list[tuple[float, float]]]]:
    """(parameters, {"ours"|"hf": [(wall steps/s, cpu steps/s) per repeat]}) of one architecture."""
    cfg = ModelConfig(
        arch=arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_kv_heads=None if arch == "gpt" else args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        seq_length=args.seq,
        max_position_embeddings=args.seq + 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    ours, ref = model_pair(cfg)
    # Our sequence is one shorter than the transformers one, which drops its last position in the loss.
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    steps = {"ours": step_fn(ours, ids, hf=False), "hf": step_fn(ref, ids, hf=True)}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    rates: dict[str, list[tuple[float, float]]] = {"ours": [], "hf": []}
    for r in range(args.repeats):
        order = ["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]
        for name in order:
            rates[name].append(measure(steps[name], args.steps))
    return sum(p.numel() for p in ours.parameters()), rates


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for each requested architecture and print the table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"fp32, {args.threads} threads, batch {args.batch} x seq {args.seq}, layers {args.layers}, "
        f"hidden {args.hidden}, heads {args.heads}, vocab {args.vocab}; median of {args.repeats} x "
        f"{args.steps} steps; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    # The CPU-time rate (process CPU seconds, all threads) is less sensitive to other jobs sharing the CPUs.
    print(f"{'arch':<7}{'params':>11}{'llmtrain it/s':>15}{'HF it/s':>9}{'ratio':>7}{'ratio (cpu time)':>18}")
    for arch in args.arch.split(","):
        n, rates = bench(arch.strip(), args)
        ours, hf = (statistics.median(r[0] for r in rates[k]) for k in ("ours", "hf"))
        ours_cpu, hf_cpu = (statistics.median(r[1] for r in rates[k]) for k in ("ours", "hf"))
        print(
            f"{arch:<7}{n:>11,}{ours:>15.3f}{hf:>9.3f}{ours / hf:>7.3f}{ours_cpu / hf_cpu:>18.3f}", flush=True
        )


if __name__ == "__main__":
    main()
