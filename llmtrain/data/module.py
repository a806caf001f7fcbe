"""`build_data`: what the trainer calls to get tokens (contract E), resharding-safe by construction.

Global batch b is samples [c + b*G, c + (b+1)*G) of one fixed global order (c = consumed samples at
start, G = global batch size); data-parallel rank r of D reads the r-th of D equal slices, or with uneven
shares (train.dp_micro_batches) the r-th of D contiguous slices of those sizes. The order depends only on
the seed and the data, so a run resumed with another D or other shares continues exactly.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from llmtrain.config.schema import JobConfig
from llmtrain.data.cache import file_identity, fingerprint, locked
from llmtrain.data.corpus import prepare_corpus
from llmtrain.data.errors import DataError
from llmtrain.data.gpt_dataset import BlendedDataset, GPTDataset, split_ranges
from llmtrain.data.indexed import IndexedDataset, bin_path
from llmtrain.data.progress import is_local_leader, say
from llmtrain.data.raw import RawStream, Workers, raw_streams
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer

Samples = GPTDataset | BlendedDataset | RawStream


def entropy_nats(counts: np.ndarray) -> float:
    """Entropy in nats of the distribution proportional to `counts`."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def slice_of_batch(
    global_batch_size: int, dp_rank: int, dp_size: int, shares: Sequence[int] = ()
) -> tuple[int, int]:
    """[start, stop) of rank dp_rank's share within a global batch: the r-th of dp_size equal slices, or
    with `shares` (samples per replica, summing to the global batch) the r-th slice of those sizes."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
    if shares:
        if len(shares) != dp_size or sum(shares) != global_batch_size:
            raise DataError(
                f"samples per replica {list(shares)} must be {dp_size} counts summing to "
                f"train.global_batch_size={global_batch_size}; fix train.dp_micro_batches"
            )
        start = sum(shares[:dp_rank])
        return start, start + shares[dp_rank]
    if global_batch_size % dp_size:
        raise DataError(
            f"train.global_batch_size={global_batch_size} is not divisible by the data-parallel size "
            f"{dp_size}; make it a multiple"
        )
    per_rank = global_batch_size // dp_size
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


class DataModule:
    """Tokenizer, entropy baseline and this rank's batches of the train and valid splits.

    With raw sources (data.sources) every rank reads the whole global sample stream (packing needs every
    document before a sample) and keeps its slice; the stream's position is `position(consumed_samples)`,
    what the checkpoint stores, and `train_batches` continues from it on any number of ranks.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        train: Samples,
        valid: Samples | None,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        unigram_entropy: float,
        num_workers: int = 0,
        shares: Sequence[int] = (),
        raw: Sequence[RawStream] = (),
        workers: Workers | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self.unigram_entropy = unigram_entropy
        self.train, self.valid = train, valid
        self.global_batch_size = global_batch_size
        self._lo, self._hi = slice_of_batch(global_batch_size, dp_rank, dp_size, shares)
        self.num_workers = num_workers
        self.raw, self.workers = list(raw), workers

    def _batch(self, source: Samples, first: int) -> torch.Tensor:
        source.prepare(first + self.global_batch_size)
        rows = [source[first + i] for i in range(self._lo, self._hi)]
        return torch.from_numpy(np.stack(rows))

    def _raw_taken(self, consumed_samples: int) -> list[int]:
        """Samples of each raw train stream among the first consumed_samples of the train split."""
        if not isinstance(self.train, BlendedDataset):
            return [consumed_samples]
        taken = self.train.taken(consumed_samples)
        return [n for ds, n in zip(self.train.datasets, taken, strict=True) if isinstance(ds, RawStream)]

    def position(self, consumed_samples: int) -> dict | None:
        """The raw streams' positions after consumed_samples train samples (None without raw sources):
        the same on every rank, whatever the layout."""
        if not self.raw:
            return None
        taken = self._raw_taken(consumed_samples)
        return {"raw": [ds.state(n) for ds, n in zip(self.raw, taken, strict=True)]}

    def train_batches(
        self, consumed_samples: int = 0, position: dict | None = None
    ) -> Iterator[torch.Tensor]:
        """Endless: this rank's slice (its share of the global batch, seq+1) of each global batch after
        consumed_samples; raw streams continue from `position` (what position() gave) when it is of the
        same data, else they re-read from the start up to consumed_samples."""
        firsts = itertools.count(consumed_samples, self.global_batch_size)
        if self.raw:
            states = (position or {}).get("raw", [])
            found = [ds.seek(st) for ds, st in zip(self.raw, states, strict=False)]
            if position and not (len(states) == len(self.raw) and all(found)) and is_local_leader():
                say(
                    "[data] the checkpoint's data position is of other data.sources: re-reading them up to it"
                )
        if self.num_workers == 0 or self.raw:  # raw streams tokenize in their own workers
            for first in firsts:
                yield self._batch(self.train, first)
        else:  # worker processes assemble upcoming batches while the trainer computes
            batches = _Batches(self, self.train)
            yield from DataLoader(
                batches,
                batch_size=None,
                sampler=firsts,
                num_workers=self.num_workers,
                # Batches are deterministic, so workers need no seed: a private generator keeps the
                # DataLoader from drawing its base seed from the global RNG, which would shift dropout
                # after a resume (the loader is made anew there) and break bitwise-exact resumption.
                generator=torch.Generator(),
                worker_init_fn=_ignore_stop_signals,
            )

    def eval_batches(self, num_batches: int) -> Iterator[torch.Tensor]:
        """The first num_batches global batches of the valid split (this rank's slices), same every call."""
        if self.valid is None:
            raise DataError("the valid split is empty; give it a share in data.split (e.g. 98,2,0)")
        for b in range(num_batches):
            yield self._batch(self.valid, b * self.global_batch_size)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers leave SIGINT/SIGTERM to the trainer, which finishes its step and saves: Slurm signals every
    process of the job, and a worker dying of it would end the run before that save."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Batches(Dataset):
    """Map-style view for DataLoader workers: item `first` is this rank's slice of the batch from there."""

    def __init__(self, module: DataModule, source: GPTDataset | BlendedDataset) -> None:
        self.module, self.source = module, source

    def __getitem__(self, first: int) -> torch.Tensor:
        return self.module._batch(self.source, first)


def _unigram_counts(ds: GPTDataset, vocab_size: int, cache_dir: Path) -> np.ndarray:
    key = fingerprint("counts", file_identity(bin_path(ds.indexed.prefix)), ds.first, ds.last, vocab_size)
    path = cache_dir / f"counts-{key}.npy"
    with locked(path):
        if path.exists():
            return np.load(path)
        counts = ds.token_counts(vocab_size)
        tmp = path.with_name(path.stem + ".tmp.npy")
        np.save(tmp, counts)
        os.replace(tmp, path)
    return counts


def _open(prefix: str, named: bool) -> IndexedDataset:
    try:
        return IndexedDataset(os.path.expanduser(prefix))
    except DataError as e:
        if not named:  # the built-in corpus' own files: the message names them already
            raise
        raise DataError(f"data.prefixes entry {prefix!r}: {e}") from None


def _check_dtype(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    dt = indexed.dtype
    if dt.kind not in "iu":
        raise DataError(f"{bin_path(indexed.prefix)} holds {dt} values, not token ids; regenerate it")
    if tokenizer.vocab_size - 1 > np.iinfo(dt).max:
        raise DataError(
            f"{bin_path(indexed.prefix)} stores tokens as {dt} (ids up to {np.iinfo(dt).max}) but the "
            f"tokenizer has {tokenizer.vocab_size} tokens: the dataset was written with another tokenizer; "
            "re-run tools/preprocess_data.py with this tokenizer or set data.tokenizer to the dataset's one"
        )


def _check_vocab(tokenizer: Tokenizer, model_vocab: int, origin: str) -> None:
    if tokenizer.vocab_size > model_vocab:
        raise DataError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens, {origin}); set model.vocab_size >= {tokenizer.vocab_size}"
        )


def build_data(job: JobConfig, dp_rank: int = 0, dp_size: int = 1) -> DataModule:
    """The DataModule of `job` for data-parallel rank dp_rank of dp_size (prepares caches on first use)."""
    d, m, t = job.data, job.model, job.train
    shares = [count * t.micro_batch_size for count in t.dp_micro_batches]
    slice_of_batch(t.global_batch_size, dp_rank, dp_size, shares)  # fail early on an indivisible batch
    if d.num_workers < 0:
        raise DataError(
            f"data.num_workers must be >= 0 (0 reads in the training process); got {d.num_workers}"
        )
    cache = Path(os.path.expanduser(d.cache_dir))
    existing = next(p for p in (cache, *cache.parents) if p.exists())
    if not existing.is_dir():
        raise DataError(
            f"data.cache_dir={d.cache_dir}: {existing} is a file; choose a directory for data.cache_dir"
        )
    for field_, given in (("data.prefixes", d.prefixes), ("data.sources", d.sources)):
        if given and not d.tokenizer:
            raise DataError(
                f"{field_} needs data.tokenizer: set it to a SentencePiece .model or a Hugging Face "
                "tokenizer directory"
                + (" (the one the data was built with)" if field_ == "data.prefixes" else "")
            )
    # A given tokenizer is checked before the corpus is prepared with it: a mismatch fails in seconds.
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer else None
    if tokenizer is not None:
        _check_vocab(tokenizer, m.vocab_size, d.tokenizer)
    if d.prefixes or d.sources:
        prefixes = list(d.prefixes)
    else:
        corpus = prepare_corpus(d.corpus, cache, m.vocab_size, d.tokenizer)
        tokenizer, prefixes = tokenizer or load_tokenizer(corpus.tokenizer), [corpus.prefix]
        _check_vocab(tokenizer, m.vocab_size, "trained on the corpus")
    entries = len(prefixes) + len(d.sources)
    if d.weights and len(d.weights) != entries:
        raise DataError(
            f"data.weights has {len(d.weights)} entries but data.prefixes and data.sources have {entries}; "
            "give one weight per prefix, then one per source (or none for proportional to size)"
        )
    if d.sources and entries > 1 and not d.weights:
        raise DataError(
            f"data.sources with {entries - 1} other entr{'ies' if entries > 2 else 'y'} needs data.weights "
            "(one per prefix, then one per source): raw sources have no size known in advance"
        )
    workers = Workers(d.num_workers)
    raw_train, raw_valid = raw_streams(
        list(d.sources),
        d.split,
        m.seq_length,
        d.tokenizer or "",
        d.text_key,
        d.on_bad_document,
        workers,
        say if is_local_leader() else None,
        job.train.seed if d.shuffle_documents else None,
    )
    index_cache = cache / "index"
    trains: list[Samples] = []
    valids: list[Samples] = []
    valid_of: list[int] = []  # the train entry of each valid split
    counts = []
    # Every dataset opened (and checked) before any index is built: a bad last prefix fails in seconds.
    for indexed in [_open(prefix, named=bool(d.prefixes)) for prefix in prefixes]:
        _check_dtype(indexed, tokenizer)
        tr, va, _ = split_ranges(len(indexed), d.split)
        trains.append(GPTDataset(indexed, tr, m.seq_length, t.seed, index_cache, "train"))
        if va[1] > va[0] and indexed.sequence_lengths[va[0] : va[1]].sum() > 0:
            valids.append(GPTDataset(indexed, va, m.seq_length, t.seed, index_cache, "valid"))
            valid_of.append(len(trains) - 1)
        c = _unigram_counts(trains[-1], tokenizer.vocab_size, index_cache)
        max_id = int(np.flatnonzero(c)[-1])
        if max_id >= tokenizer.vocab_size:
            raise DataError(
                f"{bin_path(indexed.prefix)} contains token id {max_id} but the tokenizer has "
                f"{tokenizer.vocab_size} tokens: the dataset was written with another tokenizer; set "
                "data.tokenizer to that one or re-run tools/preprocess_data.py with this one"
            )
        counts.append(np.pad(c, (0, m.vocab_size - len(c))))
    for stream in raw_train:  # each source's first tokens: a source without readable text fails now
        counts.append(
            np.pad(stream.token_counts(tokenizer.vocab_size), (0, m.vocab_size - tokenizer.vocab_size))
        )
    if t.eval_interval > 0:
        for stream in raw_valid:
            stream.token_counts(tokenizer.vocab_size, max_tokens=1)
    valid_of += [len(trains) + k for k in range(len(raw_valid))]
    trains += raw_train
    valids += raw_valid
    if d.weights:
        weights = list(d.weights)
    else:  # prefixes alone (raw sources with others need weights, checked above)
        weights = [float(getattr(ds, "tokens_per_epoch", 1)) for ds in trains]
    mixture = sum(w / sum(weights) * c / c.sum() for w, c in zip(weights, counts, strict=True))
    train = trains[0] if len(trains) == 1 else BlendedDataset(trains, weights)
    valid = None
    if len(valids) == 1:
        valid = valids[0]
    elif raw_valid:  # raw sources have no size: the valid splits blend like the training mixture
        valid = BlendedDataset(valids, [weights[i] for i in valid_of])
    elif valids:  # blend the valid splits by size: the weights describe the training mixture
        valid = BlendedDataset(valids, [float(v.tokens_per_epoch) for v in valids])
    if valid is None and t.eval_interval > 0:
        raise DataError(
            f"data.split={d.split!r} leaves the valid split without tokens (datasets of "
            f"{[len(x.indexed) for x in trains]} documents) but train.eval_interval={t.eval_interval}; "
            "give valid a larger share (at least one document) or set train.eval_interval=0"
        )
    train.prepare(t.steps * t.global_batch_size)
    if valid is not None:
        valid.prepare(max(1, t.eval_batches) * t.global_batch_size)
    return DataModule(
        tokenizer,
        train,
        valid,
        t.global_batch_size,
        dp_rank,
        dp_size,
        entropy_nats(np.asarray(mixture)),
        num_workers=d.num_workers,
        shares=shares,
        raw=raw_train,
        workers=workers,
    )
