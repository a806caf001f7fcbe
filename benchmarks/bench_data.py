"""Data pipeline throughput against the references, measured in the same run, printed as ratios.

1. Preprocessing tokens/s: llmtrain's preprocess_files vs `datasets` (load_dataset("json") + map with
   the same SentencePiece tokenizer, batched, same number of processes), on the same JSONL input.
2. Read samples/s on the same `.bin`/`.idx` files: whole documents in random order, and GPT training
   samples (seq_length+1 token windows crossing documents, the same sample list) assembled with each
   reader's get(), llmtrain's IndexedDataset vs megatron-core's.
3. Training samples fed, in tokens/s, from the same JSONL: data.sources (tokenized on the fly by 1 and by
   --workers worker processes, and per worker), the offline `.bin` (GPTDataset, after preprocessing), and
   `datasets.map` + a torch DataLoader (load_dataset("json"), tokenize and pack into blocks, batches of 8:
   how Hugging Face Trainer users feed data), its map counted, as the first epoch pays it.
4. The trainer's data time at an accelerator's step time: the global batches of --config (default
   configs/llama-1b.yaml: 64 samples of 8192 tokens) fetched from data.sources with --workers tokenizing
   processes, the step itself replaced by a sleep of the step time that --step-tokens-per-s gives (the
   README's measured H100 throughput for that config), during which the workers tokenize ahead; the warm
   fetches' mean is the progress line's data_time_s, printed as a share of the step.

Sections 2 and 3 use --seq-length, by default the config's (llama-1b: 8192).

    python benchmarks/bench_data.py [--workers 2] [--max-mb 12] [--samples 20000] [--config ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from llmtrain.config import load
from llmtrain.data.corpus import _read_documents, stdlib_files
from llmtrain.data.gpt_dataset import GPTDataset
from llmtrain.data.indexed import IndexedDataset
from llmtrain.data.preprocess import preprocess_files
from llmtrain.data.raw import SPLIT_CYCLE, RawStream, Workers, parse_source
from llmtrain.data.tokenizer import SentencePieceTokenizer, train_sentencepiece


def _best(fns: list, repeats: int) -> list[float]:
    """Fastest wall time of each function over `repeats` interleaved rounds (fair under drifting load)."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [min(t) for t in times]


def bench_preprocess(
    jsonl: str, tok_path: str, workers: int, tmp: Path, repeats: int
) -> tuple[float, float, int]:
    """(ours tokens/s, datasets tokens/s, tokens) for the same input, tokenizer and process count."""
    import datasets

    datasets.disable_progress_bars()
    tokens = 0

    def ours() -> None:
        nonlocal tokens
        stats = preprocess_files(  # each repeat replaces the previous one's output
            [jsonl], str(tmp / "ours"), tok_path, append_eod=True, workers=workers, log=None, overwrite=True
        )
        tokens = next(iter(stats.values())).tokens

    def theirs() -> None:
        cache = tempfile.mkdtemp(dir=tmp)  # a fresh cache: no run may reuse an earlier run's arrow files
        ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache)
        tok = SentencePieceTokenizer(tok_path)

        def encode(batch: dict) -> dict:
            return {"ids": [ids + [tok.eod_id] for ids in tok.encode_batch(batch["text"])]}

        out = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
        assert sum(len(x) for x in out["ids"]) == tokens  # same tokens as ours: a like-for-like comparison

    t_ours, t_theirs = _best([ours, theirs], repeats)
    return tokens / t_ours, tokens / t_theirs, tokens


def bench_read(prefix: str, samples: int, seq_length: int, repeats: int) -> dict[str, tuple[float, float]]:
    """samples/s (ours, megatron-core) for random document reads and for GPT sample assembly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    ours, theirs = IndexedDataset(prefix), MegatronIndexed(prefix)
    rng = np.random.default_rng(0)
    doc_ids = rng.integers(0, len(ours), size=samples).tolist()

    def docs(reader) -> None:
        for i in doc_ids:
            reader[i].sum()  # touch the tokens: a read that is never used costs nothing

    # The GPT sample list (document pieces per sample) comes from our index; both readers assemble it.
    gpt = GPTDataset(ours, (0, len(ours)), seq_length, seed=0)
    gpt.prepare(samples)
    pieces = []
    for i in range(samples):
        s = int(gpt._shuffle_idx[i])
        (j0, o0), (j1, o1) = gpt._sample_idx[s], gpt._sample_idx[s + 1]
        span = [(int(gpt._doc_idx[j]), 0, None) for j in range(j0, j1 + 1)]
        span[0] = (span[0][0], int(o0), None)
        span[-1] = (span[-1][0], span[-1][1], int(o1) + 1 - span[-1][1])
        pieces.append(span)

    def windows(reader) -> None:
        for span in pieces:
            np.concatenate([reader.get(d, offset=o, length=n) for d, o, n in span]).astype(np.int64)

    def ours_gpt() -> None:
        for i in range(samples):
            gpt[i]

    t_docs = _best([lambda: docs(ours), lambda: docs(theirs)], repeats)
    t_win = _best([lambda: windows(ours), lambda: windows(theirs), ours_gpt], repeats)
    return {
        "documents": (samples / t_docs[0], samples / t_docs[1]),
        "gpt windows": (samples / t_win[0], samples / t_win[1]),
        "GPTDataset[i]": (samples / t_win[2], samples / t_win[1]),
    }


def bench_feed(
    jsonl: str, tok_path: str, prefix: str, samples: int, seq_length: int, workers: int, repeats: int
) -> dict[str, float]:
    """Tokens/s of training samples (seq_length+1 tokens) delivered by each way of feeding them."""
    import datasets
    import torch

    datasets.disable_progress_bars()
    source, every_record = parse_source(jsonl), tuple(range(SPLIT_CYCLE))
    indexed = IndexedDataset(prefix)
    samples = min(samples, int(indexed.sequence_lengths.sum()) // (seq_length + 1))

    def on_the_fly(count: int) -> None:
        pool = Workers(count)
        stream = RawStream(source, "train", every_record, seq_length, tok_path, "text", workers=pool)
        for i in range(samples):
            stream[i]
        pool.close()

    def offline() -> None:
        gpt = GPTDataset(indexed, (0, len(indexed)), seq_length, seed=0)
        gpt.prepare(samples)
        for i in range(samples):
            gpt[i]

    def hf_dataloader() -> None:
        cache = tempfile.mkdtemp()
        ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache)
        tok, block = SentencePieceTokenizer(tok_path), seq_length + 1

        def encode(batch: dict) -> dict:
            return {"ids": [ids + [tok.eod_id] for ids in tok.encode_batch(batch["text"])]}

        def group(batch: dict) -> dict:  # the run_clm recipe: concatenate, cut into blocks
            flat = [t for ids in batch["ids"] for t in ids]
            return {"input_ids": [flat[i : i + block] for i in range(0, len(flat) - block + 1, block)]}

        procs = workers if workers > 1 else None
        ds = ds.map(encode, batched=True, num_proc=procs, remove_columns=ds.column_names)
        ds = ds.map(group, batched=True, num_proc=procs, remove_columns=["ids"]).with_format("torch")
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=min(workers, 2))
        seen = 0
        for batch in loader:
            seen += len(batch["input_ids"])
            if seen >= samples:
                break

    counts = sorted({1, workers})
    fns = [lambda c=c: on_the_fly(c) for c in counts] + [offline, hf_dataloader]
    times = _best(fns, repeats)
    tokens = samples * (seq_length + 1)
    out = {f"on the fly, {c} worker{'s' * (c > 1)}": tokens / t for c, t in zip(counts, times, strict=False)}
    out.update({"on the fly, per worker": tokens / times[len(counts) - 1] / counts[-1]})
    out.update(
        {"offline .bin (GPTDataset)": tokens / times[-2], "datasets.map + DataLoader": tokens / times[-1]}
    )
    return out


def bench_data_time(
    jsonl: str, tok_path: str, seq_length: int, batch: int, step_s: float, workers: int, steps: int
) -> list[float]:
    """Seconds the trainer would wait for each warm global batch of `batch` samples from data.sources with
    `workers` tokenizing processes when the rest of a step takes `step_s` (slept, as the accelerator would
    compute); the first, cold fetch is left out."""
    pool = Workers(workers)
    stream = RawStream(parse_source(jsonl), "train", tuple(range(SPLIT_CYCLE)), seq_length, tok_path, "text",
                       workers=pool)  # fmt: skip
    waits, sample = [], 0
    for _ in range(steps + 1):
        start = time.perf_counter()
        for _ in range(batch):
            stream[sample]
            sample += 1
        waits.append(time.perf_counter() - start)
        time.sleep(step_s)
    pool.close()
    return waits[1:]


def main() -> None:
    """Run both comparisons on the standard library's sources and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for both tokenizers")
    ap.add_argument("--max-mb", type=float, default=12.0, help="input size cap in MB of text")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=20000, help="reads per read benchmark")
    ap.add_argument("--config", default="configs/llama-1b.yaml", help="seq length and batch of section 4")
    ap.add_argument("--seq-length", type=int, default=None, help="sections 2-3 (default: the config's)")
    ap.add_argument("--step-tokens-per-s", type=float, default=46562.0,
                    help="the config's training throughput (README: llama-1b, one H100)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="warm steps simulated in section 4")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
    args = ap.parse_args()
    job = load(args.config)
    args.seq_length = args.seq_length or job.model.seq_length

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        docs, total = [], 0
        for text in _read_documents(stdlib_files()):
            docs.append(text)
            total += len(text)
            if total >= args.max_mb * 1e6:
                break
        jsonl = tmp / "input.jsonl"
        with open(jsonl, "w") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
        tok_path = str(train_sentencepiece(docs, tmp / "tok.model", args.vocab_size))
        print(
            f"input: {len(docs)} documents, {total / 1e6:.1f} MB (Python stdlib sources), "
            f"workers={args.workers}"
        )

        ours, theirs, tokens = bench_preprocess(str(jsonl), tok_path, args.workers, tmp, args.repeats)
        print(
            f"preprocess  {tokens:,} tokens: llmtrain {ours:,.0f} tok/s  datasets.map {theirs:,.0f} tok/s  "
            f"ratio {ours / theirs:.2f}"
        )
        for name, (a, b) in bench_read(
            str(tmp / "ours_text_document"), args.samples, args.seq_length, args.repeats
        ).items():
            print(
                f"read {name:<14} llmtrain {a:,.0f} samples/s  megatron-core {b:,.0f} samples/s  "
                f"ratio {a / b:.2f}"
            )
        feed = bench_feed(
            str(jsonl),
            tok_path,
            str(tmp / "ours_text_document"),
            args.samples,
            args.seq_length,
            args.workers,
            args.repeats,
        )
        print(f"feed at seq_length {args.seq_length}:")
        for name, rate in feed.items():
            print(f"feed {name:<26} {rate:>12,.0f} tokens/s")
        gbs, seq = job.train.global_batch_size, job.model.seq_length
        step_s = gbs * seq / args.step_tokens_per_s
        waits = bench_data_time(str(jsonl), tok_path, seq, gbs, step_s, args.workers, args.steps)
        mean = sum(waits) / len(waits)
        print(
            f"data time {args.config} ({gbs} x {seq} tokens a step, {step_s:.2f} s a step at "
            f"{args.step_tokens_per_s:,.0f} tokens/s), {args.workers} workers: data_time_s {mean:.3f} s "
            f"(warm steps: {', '.join(f'{w:.3f}' for w in waits)}) = {100 * mean / (step_s + mean):.2f}% "
            "of the step"
        )


if __name__ == "__main__":
    main()
