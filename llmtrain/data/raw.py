"""Raw documents as training samples, tokenized while training (data.sources): no offline step.

A source (one entry of data.sources) is read record by record, in order, epoch after epoch. Each readable,
non-empty document of the split becomes its tokens followed by the end-of-document token, and the documents
are concatenated into one token stream; sample i is stream[i*L : i*L + L + 1], as in GPTDataset (windows
cross documents and consecutive samples share the label token). Records go to the splits by position: of
every SPLIT_CYCLE records, data.split's shares (98 train, 2 valid for 98,2,0), each split's spread evenly
over the cycle (valid: records 25 and 75 of each hundred) so a small source has a valid split. The samples
are therefore a function of the data, the tokenizer, data.split and seq_length alone: the number of
workers and of ranks do not enter. Documents keep their order, unless data.shuffle_documents: then the
split's records of each chunk (CHUNK_RECORDS records read together) are taken in a permutation drawn from
(train.seed, epoch, the chunk's first record number), a window shuffle that costs no memory or random access
and still lets a position name a record: the order is a function of the seed and the data.

Tokenizing runs in worker processes (data.num_workers per rank, shared by the rank's sources) on chunks of
records, a bounded number ahead of the trainer; results are used in submission order.

A position is where sample n starts: (epoch, record, token offset in that record's document). The checkpoint
stores it (DataModule.position); seeking re-reads the records before it without parsing or tokenizing them,
so a resume costs reading time, not tokenizing time.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import multiprocessing as mp
import os
import signal
import sys
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from llmtrain.data.errors import DataError
from llmtrain.data.gpt_dataset import blend_indices
from llmtrain.data.progress import Log, tag
from llmtrain.data.sources import (
    CHUNK_RECORDS,
    NAMED_BAD,
    BadRecord,
    BadRecords,
    Chunk,
    chunks_of_table,
    input_kind,
    parse_records,
    read_chunks,
)
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer

HUB_PREFIX = "hf:"
HUB_ARGS = ("name", "split", "data_files", "data_dir", "revision")
"""Arguments of datasets.load_dataset an hf: entry may give in its query (split defaults to train)."""
SPLIT_CYCLE = 100
"""Records are dealt to train/valid/test in cycles of this many, by data.split's shares (in percent)."""
KEY_OPTION, SKIP_OPTION = "data.text_key", "data.on_bad_document=skip"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Position(NamedTuple):
    """Where a sample starts: epoch, record number within the epoch, token offset in its document."""

    epoch: int = 0
    record: int = 0
    offset: int = 0


@dataclass(frozen=True)
class RawSource:
    """One entry of data.sources: files (a path or a glob) or a datasets.load_dataset spec."""

    entry: str
    files: tuple[str, ...] = ()
    hub: tuple[str, tuple[tuple[str, str], ...]] | None = None


def parse_source(entry: str) -> RawSource:
    """The source an entry names, checked now (existence, format, query), before any model is built."""
    if entry.startswith(HUB_PREFIX):
        path, _, query = entry[len(HUB_PREFIX) :].partition("?")
        args = urllib.parse.parse_qsl(query, keep_blank_values=True)
        unknown = sorted({k for k, _ in args} - set(HUB_ARGS))
        if not path or unknown:
            raise DataError(
                f"data.sources entry {entry!r}: write hf:NAME or hf:NAME?split=train&data_files=PATTERN "
                f"(datasets.load_dataset's arguments {', '.join(HUB_ARGS)})"
                + (f"; not {unknown}" if unknown else "")
            )
        return RawSource(entry, hub=(path, tuple(args)))
    pattern = os.path.expanduser(entry)
    files = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not files:
        raise DataError(f"data.sources entry {entry!r} matches no file (relative to {os.getcwd()})")
    for path in files:
        if not os.path.exists(path):
            raise DataError(
                f"data.sources entry {entry!r}: {path} does not exist; check the path (relative to "
                f"{os.getcwd()}), or write hf:NAME for a datasets.load_dataset name"
            )
        try:
            input_kind(path)
        except DataError as e:
            raise DataError(f"data.sources entry {entry!r}: {str(e).removeprefix('--input ')}") from None
    return RawSource(entry, files=tuple(files))


def _open_hub(source: RawSource):
    """The streaming datasets.IterableDataset of an hf: entry, or one line saying how to make it available."""
    import datasets

    assert source.hub is not None
    path, args = source.hub
    kwargs = dict(args)
    split = kwargs.pop("split", "train")
    try:
        return datasets.load_dataset(path, split=split, streaming=True, **kwargs)
    except (ConnectionError, FileNotFoundError) as e:
        if "data_files" in kwargs or "data_dir" in kwargs:
            raise DataError(f"data.sources entry {source.entry!r}: {e}; check data_files/data_dir") from None
        raise DataError(
            f"data.sources entry {source.entry!r}: {path!r} is not in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}) and cannot be fetched ({type(e).__name__}); make it "
            f"available offline by loading it once where the Hub is reachable, with the same HF_HOME: "
            f"python -c \"import datasets; datasets.load_dataset('{path}', split='{split}')\""
        ) from None
    except ValueError as e:  # an unknown split or configuration
        raise DataError(f"data.sources entry {source.entry!r}: {e}") from None


def source_inputs(source: RawSource, key: str) -> Iterator[tuple[str, Iterator[Chunk]]]:
    """Each input of the source (its files in order, or the hub dataset) with its chunks of records."""
    if source.hub is None:
        for path in source.files:
            yield path, read_chunks([path], [key], KEY_OPTION)
    else:
        rows = _open_hub(source).iter(batch_size=CHUNK_RECORDS)
        yield source.entry, chunks_of_table(source.entry, rows, [key], 0, 0, KEY_OPTION)


@dataclass
class _Job:
    """The records of one chunk that belong to a split, for a worker."""

    chunk: Chunk
    records: np.ndarray  # record number (within the epoch) of each item
    tokenizer: str
    key: str


@dataclass
class _Piece:
    """A job tokenized: its non-empty documents concatenated, each followed by the end-of-document token."""

    path: str
    records: np.ndarray  # record number of each document
    starts: np.ndarray  # where each document starts in `tokens`
    tokens: np.ndarray  # int32
    bad: list[BadRecord]  # unreadable records and empty documents
    epoch: int = 0


class _EpochEnd(NamedTuple):
    """The end of an epoch's jobs, with what its reading found (filled in as its jobs are read)."""

    epoch: int
    first: int  # the record it started from (0 unless a resume)
    empty_inputs: list[str]
    seen: list[int]  # [records read]


_tokenizers: dict[str, Tokenizer] = {}


def _tokenizer(path: str) -> Tokenizer:
    if path not in _tokenizers:
        _tokenizers[path] = load_tokenizer(path)
    return _tokenizers[path]


def encode(job: _Job) -> _Piece:
    """Parse and tokenize a job's records (runs in a worker process)."""
    tok = _tokenizer(job.tokenizer)
    readable, bad = parse_records(job.chunk, [job.key], KEY_OPTION)
    ids = tok.encode_batch([record[job.key] for _, record in readable]) if readable else []
    records, docs = [], []
    for (n, _), doc in zip(readable, ids, strict=True):
        if doc:
            records.append(job.records[n])
            docs.append(doc)
        else:
            bad.append(BadRecord(job.chunk.where(n), "empty document (no tokens)", "remove it"))
    lengths = np.fromiter((len(d) + 1 for d in docs), np.int64, len(docs))
    tokens = np.fromiter(
        itertools.chain.from_iterable(d + [tok.eod_id] for d in docs), np.int32, int(lengths.sum())
    )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return _Piece(job.chunk.path, np.asarray(records, np.int64), starts, tokens, bad)


def _init_worker() -> None:
    # The trainer acts on SIGINT/SIGTERM (it finishes the step and saves); a worker dying of the signal
    # that Slurm or Ctrl-C sends the whole group would break the pipe before that save.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # a trainer SIGKILLed (torchrun's restarts) takes its workers along
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Workers:
    """A rank's tokenizing processes, shared by its raw streams; none tokenizes in the calling process.

    Forked on Linux, as torch's DataLoader workers are: a spawned worker would need the user's script to
    guard its top level with `if __name__ == "__main__"`. The workers only parse and tokenize.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._executor: ProcessPoolExecutor | None = None

    def submit(self, job: _Job) -> Future:
        if self._executor is None:
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            self._executor = ProcessPoolExecutor(self.count, ctx, initializer=_init_worker)
        return self._executor.submit(encode, job)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class RawStream:
    """The samples of one split of one raw source, readable in increasing order (see the module's docstring).

    Reading sample i after sample j > i starts over from the nearest known position (the valid split is
    read from its start at every evaluation).
    """

    def __init__(
        self,
        source: RawSource,
        split: str,
        slots: tuple[int, ...],
        seq_length: int,
        tokenizer: str,
        key: str,
        policy: str = "skip",
        workers: Workers | None = None,
        log: Log | None = None,
        seed: int | None = None,
    ) -> None:
        self.source, self.split, self.slots, self.seq_length = source, split, slots, seq_length
        self.seed = seed
        """None: records in order; else each chunk's records shuffled by (seed, epoch, first record)."""
        self.tokenizer, self.key, self.policy = tokenizer, key, policy
        self.workers = workers or Workers(0)
        self.log = log
        self._marks: dict[int, Position] = {0: Position()}
        self._restart(0, Position())

    def identity(self) -> dict:
        """What a position depends on: the same entry, split, key, tokenizer and sample length."""
        return {
            "source": self.source.entry,
            "split": self.split,
            "slots": list(self.slots),
            "text_key": self.key,
            "tokenizer": self.tokenizer,
            "seq_length": self.seq_length,
            "shuffle_seed": self.seed,
        }

    # The pipeline: records -> jobs -> tokenized pieces (in order) -> token buffer -> samples.

    def _jobs(self, epoch: int, first: int, counted: list[str], seen: list[int]) -> Iterator[_Job]:
        """Jobs for the split's records of `epoch` from record `first` on (in reading order: numbered >= first
        unshuffled, after it in its chunk's permutation shuffled); `counted` gets each input without
        records, and seen[0] the number of records read."""
        record = 0
        mine = np.zeros(SPLIT_CYCLE, bool)
        mine[list(self.slots)] = True
        for name, chunks in source_inputs(self.source, self.key):
            records_before = record
            for chunk in chunks:
                n = len(chunk.items)
                numbers = np.arange(record, record + n, dtype=np.int64)
                record += n
                seen[0] = record
                if first >= record:
                    continue
                keep = np.flatnonzero(mine[numbers % SPLIT_CYCLE])
                if self.seed is not None:
                    keep = np.random.default_rng([self.seed, epoch, int(numbers[0])]).permutation(keep)
                if first > numbers[0]:  # the chunk a resume starts in: from its record on
                    at = np.flatnonzero(keep == first - numbers[0])
                    keep = keep[int(at[0]) :] if len(at) else keep[keep >= first - numbers[0]]
                if not len(keep):
                    continue
                lines = [chunk.lines[k] if chunk.lines else chunk.first + int(k) for k in keep]
                items = [chunk.items[k] for k in keep]
                part = Chunk(chunk.path, lines[0], chunk.kind, items, lines, chunk.nbytes)
                yield _Job(part, numbers[keep], self.tokenizer, self.key)
            if record == records_before:
                counted.append(name)

    def _all_jobs(self, start: Position) -> Iterator[_Job | _EpochEnd]:
        """The jobs of every epoch from `start` on, each epoch followed by its _EpochEnd."""
        for epoch in itertools.count(start.epoch):
            first = start.record if epoch == start.epoch else 0
            end = _EpochEnd(epoch, first, [], [0])
            yield from self._jobs(epoch, first, end.empty_inputs, end.seen)
            yield end

    def _pieces_of(self, jobs: Iterator[_Job | _EpochEnd]) -> Iterator[_Piece | _EpochEnd]:
        """Each job tokenized, in order, the epoch ends passed through. With workers, a bounded look-ahead
        across epochs: memory stays flat, and tokenizing stays ahead of training also where an epoch is a
        chunk or two (a small source)."""
        workers = self.workers
        if workers.count == 0:
            yield from (encode(job) if isinstance(job, _Job) else job for job in jobs)
            return
        pending: deque[Future | _EpochEnd] = deque()
        for job in jobs:
            pending.append(workers.submit(job) if isinstance(job, _Job) else job)
            while len(pending) >= 2 * workers.count + 2 or (pending and isinstance(pending[0], _EpochEnd)):
                first = pending.popleft()
                yield first if isinstance(first, _EpochEnd) else first.result()

    def _pieces(self, start: Position) -> Iterator[_Piece]:
        """Tokenized pieces from `start` on, epoch after epoch; the first pass read checks and reports."""
        epoch, report = start.epoch, True
        bad = BadRecords(self.policy, self.log, "data", (KEY_OPTION, SKIP_OPTION))
        documents = tokens = 0
        for piece in self._pieces_of(self._all_jobs(start)):
            if isinstance(piece, _EpochEnd):
                bad.finish()
                if documents == 0 and piece.first == 0:
                    raise self._nothing_readable(bad, piece.empty_inputs, piece.seen[0])
                if report and self.log:
                    self._report(epoch, documents, tokens, bad, piece.empty_inputs)
                epoch, report = epoch + 1, False
                bad = BadRecords(self.policy, None, "data", (KEY_OPTION, SKIP_OPTION))
                documents = tokens = 0
                continue
            bad.add(piece.path, len(piece.records), piece.bad)
            documents += len(piece.records)
            tokens += len(piece.tokens)
            if len(piece.records):
                piece.epoch = epoch
                yield piece

    def _nothing_readable(self, bad: BadRecords, empty_inputs: list[str], records: int) -> DataError:
        why = [f"{len(empty_inputs)} empty input{'s' * (len(empty_inputs) != 1)}"] if empty_inputs else []
        why += [bad.summary()] if bad.count else []
        where = ""
        if self.split != "train":
            where = (
                f"; it has {records} records and the {self.split} split takes those numbered "
                f"{', '.join(map(str, self.slots))} of every {SPLIT_CYCLE}: give it a larger share in "
                "data.split"
            )
        return DataError(
            f"data.sources entry {self.source.entry!r} gives no readable {self.split} document"
            + (f" ({'; '.join(why)})" if why else "")
            + f"{where}: check that its records hold the text under data.text_key={self.key!r}"
        )

    def _report(self, epoch: int, documents: int, tokens: int, bad: BadRecords, empty: list[str]) -> None:
        assert self.log is not None
        for path in empty[:NAMED_BAD]:
            self.log(f"{tag('data')} skipping {path}: no records")
        skipped = [f"{len(empty)} empty input{'s' * (len(empty) != 1)} skipped"] if empty else []
        skipped += [bad.summary()] if bad.count else []
        self.log(
            f"{tag('data')} {self.source.entry} ({self.split}) epoch {epoch + 1} read: "
            f"{documents:,} documents, {tokens:,} tokens" + (f"; {', '.join(skipped)}" if skipped else "")
        )

    # The token buffer: pieces in order, self._pos the next sample's first token in the first piece.

    def _restart(self, sample: int, at: Position) -> None:
        self._stream = self._pieces(at)
        self._buffer: deque[_Piece] = deque()
        self._available = 0
        self._pos = 0
        self._next = sample
        self._resume_at = at  # its offset applies to the first piece, read on first use

    def _fill(self, n: int) -> None:
        while self._available < n:
            piece = next(self._stream)
            self._buffer.append(piece)
            self._available += len(piece.tokens)
            at, self._resume_at = self._resume_at, None
            if at is not None and at.offset:
                self._check_resumed(piece, at)
                self._pos = at.offset
                self._available -= at.offset

    def _check_resumed(self, piece: _Piece, at: Position) -> None:
        doc_end = piece.starts[1] if len(piece.starts) > 1 else len(piece.tokens)
        if piece.epoch != at.epoch or piece.records[0] != at.record or at.offset >= doc_end:
            raise DataError(
                f"data.sources entry {self.source.entry!r} changed since the checkpoint: record {at.record} "
                f"of epoch {at.epoch + 1} is not the document it was; restore the data or start afresh"
            )

    def _advance(self, n: int) -> None:
        self._fill(n + 1)  # the next sample's first token is then in the buffer, for its position
        self._pos += n
        self._available -= n
        while self._pos >= len(self._buffer[0].tokens):
            self._pos -= len(self._buffer.popleft().tokens)

    def _take(self, n: int) -> np.ndarray:
        self._fill(n)
        out = np.empty(n, np.int64)
        got, pos = 0, self._pos
        for piece in self._buffer:
            m = min(n - got, len(piece.tokens) - pos)
            out[got : got + m] = piece.tokens[pos : pos + m]
            got, pos = got + m, 0
            if got == n:
                break
        return out

    def _goto(self, sample: int) -> None:
        if sample < self._next:
            mark = max(m for m in self._marks if m <= sample)
            self._restart(mark, self._marks[mark])
        while self._next < sample:
            self._advance(self.seq_length)
            self._next += 1

    def position(self, sample: int) -> Position:
        """Where sample `sample` starts (reads up to it)."""
        self._goto(sample)
        piece = self._buffer[0]
        j = int(np.searchsorted(piece.starts, self._pos, side="right")) - 1
        return Position(piece.epoch, int(piece.records[j]), int(self._pos - piece.starts[j]))

    def state(self, sample: int) -> dict:
        """The checkpointable position of sample `sample`, with what it depends on."""
        return {**self.identity(), "sample": sample, **self.position(sample)._asdict()}

    def seek(self, state: dict) -> bool:
        """Continue from a state of `state`'s kind; False (and nothing changed) when it is of other data."""
        fields = {k: state.get(k) for k in self.identity()}
        if fields != self.identity():
            return False
        at = Position(int(state["epoch"]), int(state["record"]), int(state["offset"]))
        self._marks[int(state["sample"])] = at
        self._restart(int(state["sample"]), at)
        return True

    def prepare(self, num_samples: int) -> None:
        """Nothing to prepare: samples are read as they are asked for (GPTDataset's interface)."""

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i: seq_length+1 int64 tokens."""
        self._goto(i)
        sample = self._take(self.seq_length + 1)
        self._advance(self.seq_length)
        self._next += 1
        return sample

    def token_counts(self, vocab_size: int, max_tokens: int = 1 << 14) -> np.ndarray:
        """Occurrences of each token id in the split's first chunks, up to about max_tokens tokens or one
        epoch (the unigram baseline's estimate: every rank reads them at start), read in this process by a
        pipeline of its own (this stream's position is kept); a source without readable documents fails
        here, before a model is built."""
        counts = np.zeros(vocab_size, np.int64)
        seen = 0
        probe = RawStream(
            self.source, self.split, self.slots, self.seq_length, self.tokenizer, self.key, self.policy
        )
        for piece in probe._pieces(Position()):
            if piece.epoch > 0:  # a small source: its whole first epoch is read
                break
            counts += np.bincount(piece.tokens, minlength=vocab_size)[:vocab_size]
            seen += len(piece.tokens)
            if seen >= max_tokens:
                break
        return counts


def split_slots(split: str) -> list[tuple[int, ...]]:
    """The positions within a cycle of SPLIT_CYCLE records of each of train/valid/test, by data.split's
    shares, each split's spread evenly (blend_indices deals them)."""
    shares = [float(x) for x in split.split(",")]
    which, _ = blend_indices(shares, SPLIT_CYCLE)
    return [tuple(int(j) for j in np.flatnonzero(which == k)) for k in range(3)]


def raw_streams(
    entries: list[str],
    split: str,
    seq_length: int,
    tokenizer: str,
    key: str,
    policy: str,
    workers: Workers,
    log: Callable[[str], None] | None,
    seed: int | None = None,
) -> tuple[list[RawStream], list[RawStream]]:
    """Train and valid streams of each entry (valid: those with a share of the records); `seed`: shuffle
    each chunk's records by it (None: in order)."""
    sources = [parse_source(e) for e in entries]  # every entry checked before any is read
    (tr, va, _) = split_slots(split)
    trains = [
        RawStream(s, "train", tr, seq_length, tokenizer, key, policy, workers, log, seed) for s in sources
    ]
    valids = []
    if va:
        valids = [
            RawStream(s, "valid", va, seq_length, tokenizer, key, policy, workers, None, seed)
            for s in sources
        ]
    return trains, valids
