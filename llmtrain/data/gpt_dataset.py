"""GPT-style datasets: fixed-length windows over a shuffled token stream, and weighted blends of them.

The sample order is a pure function of (data, split, seq_length, seed) and is defined for every sample
index, however many are drawn: epoch e shuffles the split's documents with a generator seeded by
(seed, e), the epochs are concatenated into one token stream, sample i is stream[i*L : i*L + L + 1]
(windows cross document boundaries and overlap by the one label token), and the samples that start in
epoch e are shuffled among themselves with a generator seeded by (seed, e). Growing the number of
samples therefore only appends: earlier samples never change, so `consumed_samples` is the whole state.
Index arrays (document, sample, shuffle) are materialised on demand and cached on disk.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from llmtrain.data.cache import build_dir_once, file_identity, fingerprint
from llmtrain.data.errors import DataError
from llmtrain.data.indexed import IndexedDataset, bin_path, idx_path

_INDEX_VERSION = 1  # bump when the index construction changes, to invalidate caches


def split_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Contiguous train/valid/test document ranges for a 'train,valid,test' proportion string."""
    try:
        shares = [float(x) for x in split.split(",")]
    except ValueError:
        shares = []
    if len(shares) != 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise DataError(f"data.split must be three non-negative proportions like 98,2,0; got {split!r}")
    bounds = np.round(np.cumsum([0.0, *shares]) / sum(shares) * num_docs).astype(int)
    bounds[-1] = num_docs
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, stream]))


class GPTDataset:
    """Samples of seq_length+1 token ids from documents [first, last) of an indexed dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        seed: int,
        cache_dir: Path | None = None,
        split_name: str = "train",
    ) -> None:
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.first, self.last = doc_range
        self.cache_dir, self.split_name = cache_dir, split_name
        self.lengths = indexed.sequence_lengths[self.first : self.last].astype(np.int64)
        self.tokens_per_epoch = int(self.lengths.sum())
        if self.tokens_per_epoch == 0:
            raise DataError(
                f"the {split_name} split of {indexed.prefix} (documents {self.first}..{self.last}) "
                "has no tokens; give it documents via data.split or add data to the dataset"
            )
        self._identity = [file_identity(idx_path(indexed.prefix)), file_identity(bin_path(indexed.prefix))]
        self.num_samples = 0  # materialised so far
        self._doc_idx = self._sample_idx = self._shuffle_idx = np.zeros(0, np.int64)

    def _blocks_for(self, num_samples: int) -> int:
        # Smallest number of epoch blocks whose samples cover num_samples; block e holds the samples
        # i with e*T <= i*L < (e+1)*T.
        t, l_ = self.tokens_per_epoch, self.seq_length
        b = max(1, (num_samples * l_) // t)
        while math.ceil(b * t / l_) < num_samples:
            b += 1
        return b

    def prepare(self, num_samples: int) -> None:
        """Make samples 0..num_samples-1 readable (grows geometrically, reusing the disk cache)."""
        if num_samples <= self.num_samples:
            return
        blocks = self._blocks_for(max(num_samples, 2 * self.num_samples))
        key = fingerprint(
            _INDEX_VERSION, self._identity, self.first, self.last, self.seq_length, self.seed, blocks
        )
        if self.cache_dir is None:
            arrays = self._build(blocks)
        else:
            folder = build_dir_once(
                self.cache_dir / f"gpt-{key}",
                lambda tmp: self._save(tmp, self._build(blocks)),
                f"the {self.split_name} sample index of {self.indexed.prefix}",
            )
            # Plain ndarray views of the mapped files: np.memmap's own indexing is several times slower.
            arrays = tuple(
                np.asarray(np.load(folder / f"{n}.npy", mmap_mode="r")) for n in ("doc", "sample", "shuffle")
            )
        self._doc_idx, self._sample_idx, self._shuffle_idx = arrays
        self.num_samples = len(self._shuffle_idx)

    @staticmethod
    def _save(folder: Path, arrays: tuple[np.ndarray, ...]) -> None:
        for name, arr in zip(("doc", "sample", "shuffle"), arrays, strict=True):
            np.save(folder / f"{name}.npy", arr)

    def _build(self, blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t, l_, ndocs = self.tokens_per_epoch, self.seq_length, len(self.lengths)
        n = math.ceil(blocks * t / l_)  # samples of the first `blocks` epoch blocks
        # The last sample ends at token n*L + 1 (exclusive); enough epochs of documents to reach it.
        epochs = math.ceil((n * l_ + 1) / t)
        doc_idx = np.concatenate([_rng(self.seed, e, 0).permutation(ndocs) for e in range(epochs)])
        lens = self.lengths[doc_idx]
        ends = np.cumsum(lens)
        starts = np.arange(n + 1, dtype=np.int64) * l_  # entry n is where sample n-1's label window ends
        j = np.searchsorted(
            ends, starts, side="right"
        )  # first document ending after the start: skips empty ones
        offsets = starts - (ends[j] - lens[j])
        sample_idx = np.stack([j, offsets], axis=1).astype(np.int64)
        shuffle = []
        for e in range(blocks):
            lo, hi = math.ceil(e * t / l_), math.ceil((e + 1) * t / l_)
            shuffle.append(lo + _rng(self.seed, e, 1).permutation(hi - lo))
        return doc_idx.astype(np.int64), sample_idx, np.concatenate(shuffle).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i (must be < num_samples: call prepare first) as int64 tokens of length seq_length+1."""
        s, idx, doc, first = self._shuffle_idx[i], self._sample_idx, self._doc_idx, self.first
        j0, o0, j1, o1 = idx[s, 0], idx[s, 1], idx[s + 1, 0], idx[s + 1, 1]
        if j0 == j1:
            return self.indexed.get(first + doc[j0], o0, o1 - o0 + 1).astype(np.int64)
        parts = [self.indexed.get(first + doc[j0], o0)]
        parts += [self.indexed[first + doc[j]] for j in range(j0 + 1, j1)]
        parts.append(self.indexed.get(first + doc[j1], 0, o1 + 1))
        return np.concatenate(parts, dtype=np.int64)

    def token_counts(self, vocab_size: int, max_tokens: int = 100_000_000) -> np.ndarray:
        """Occurrences of each token id in the split (its first max_tokens tokens, in storage order)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        tokens = self.indexed.tokens(self.first, self.last)[:max_tokens]
        for lo in range(0, len(tokens), 1 << 24):  # chunks keep the int64 temporaries small
            c = np.bincount(tokens[lo : lo + (1 << 24)].astype(np.int64))
            if len(c) > len(counts):
                counts = np.pad(counts, (0, len(c) - len(counts)))
            counts[: len(c)] += c
        return counts


def blend_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset and which of its samples each blended sample comes from.

    Greedy: sample i goes to the dataset furthest behind its share, argmax_d(w_d*(i+1) - taken_d),
    ties to the lowest index; the choice for i depends only on the weights, so prefixes are stable.
    """
    w = [x / sum(weights) for x in weights]
    taken = [0] * len(w)
    which = np.empty(num_samples, dtype=np.int64)
    nth = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        errs = [wd * (i + 1) - td for wd, td in zip(w, taken, strict=True)]
        d = errs.index(max(errs))
        which[i], nth[i] = d, taken[d]
        taken[d] += 1
    return which, nth


class BlendedDataset:
    """A weighted interleaving of several sample sources (GPTDatasets, RawStreams)."""

    def __init__(self, datasets: list, weights: list[float]) -> None:
        if len(weights) != len(datasets):
            raise DataError(
                f"data.weights has {len(weights)} entries but data.prefixes has {len(datasets)}; "
                "give one weight per prefix (or none for proportional to size)"
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"data.weights must be >= 0 and not all zero; got {weights}")
        self.datasets, self.weights = datasets, list(weights)
        self.num_samples = 0
        self._which = self._nth = np.zeros(0, np.int64)

    def prepare(self, num_samples: int) -> None:
        """Make samples 0..num_samples-1 readable."""
        if num_samples <= self.num_samples:
            return
        n = max(num_samples, 2 * self.num_samples)
        self._which, self._nth = blend_indices(self.weights, n)
        for d, ds in enumerate(self.datasets):
            taken = self._nth[self._which == d]
            if len(taken):
                ds.prepare(int(taken.max()) + 1)
        self.num_samples = n

    def __len__(self) -> int:
        return self.num_samples

    def taken(self, num_samples: int) -> list[int]:
        """How many of the first num_samples blended samples each dataset gives."""
        self.prepare(num_samples)
        which = self._which[:num_samples]
        return [int((which == d).sum()) for d in range(len(self.datasets))]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self._which[i])][int(self._nth[i])]
