"""Tokenize raw documents into indexed datasets with worker processes, streaming, in input order.

Nothing is thrown away for a blank line: documents without tokens are skipped and counted, and so are
unreadable records unless asked to stop (see llmtrain.data.sources). The output is all or nothing: the
datasets appear under their names only once every one of them is complete, an interruption (an error,
Ctrl-C, or SIGTERM turned into an exception by the tool) removes the partial files, and an existing
dataset is replaced only when asked.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from llmtrain.data.errors import DataError
from llmtrain.data.indexed import IndexedDatasetWriter, check_new_output, dtype_for_vocab
from llmtrain.data.progress import INTERVAL_S, Log, Progress, duration, say, size, tag
from llmtrain.data.sources import (
    CHUNK_BYTES,
    CHUNK_RECORDS,
    BadRecord,
    BadRecords,
    Chunk,
    check_inputs,
    parse_chunk,
    read_chunks,
)
from llmtrain.data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer


@dataclass
class PreprocessStats:
    """What one preprocessing run wrote into one dataset."""

    documents: int = 0
    tokens: int = 0
    skipped_empty: int = 0
    """Documents without a single token, not written."""
    skipped_bad: int = 0
    """Records that could not be read (the same for every dataset of a run: a record is read whole)."""
    seconds: float = 0.0

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class _Encoded:
    """One chunk tokenized: per key the concatenated tokens and lengths of its non-empty documents."""

    path: str
    nbytes: float
    per_key: list[tuple[np.ndarray, np.ndarray]]
    empty: list[int]
    readable: int
    bad: list[BadRecord]


class _Encoder:
    """Per-process tokenization state (one per worker, created by the pool initializer)."""

    def __init__(self, tokenizer_path: str, keys: list[str], append_eod: bool, in_pool: bool = False) -> None:
        self.tok: Tokenizer = load_tokenizer(tokenizer_path)
        if in_pool and isinstance(self.tok, SentencePieceTokenizer):
            self.tok.num_threads = (
                1  # the pool already runs one process per core; threads would oversubscribe
            )
        self.keys, self.append_eod = keys, append_eod
        self.dtype = dtype_for_vocab(self.tok.vocab_size)

    def __call__(self, chunk: Chunk) -> _Encoded:
        texts, bad = parse_chunk(chunk, self.keys)
        per_key, empty = [], []
        for column in texts:
            kept = [ids for ids in (self.tok.encode_batch(column) if column else []) if ids]
            empty.append(len(column) - len(kept))
            if self.append_eod:
                for ids in kept:
                    ids.append(self.tok.eod_id)
            lengths = np.fromiter((len(x) for x in kept), dtype=np.int64, count=len(kept))
            flat = np.fromiter(
                itertools.chain.from_iterable(kept), dtype=self.dtype, count=int(lengths.sum())
            )
            per_key.append((flat, lengths))
        return _Encoded(chunk.path, chunk.nbytes, per_key, empty, len(texts[0]), bad)


_worker: _Encoder | None = None


def _init_worker(*args) -> None:
    global _worker
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group. Only the parent acts on them: it
    # stops the workers between chunks and removes the partial output. A worker killed in the middle of
    # sending a result would leave the executor waiting for the rest of the message for ever (seen with
    # both multiprocessing.Pool and ProcessPoolExecutor), and every worker would print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _worker = _Encoder(*args)


def _work(chunk: Chunk) -> _Encoded:
    return _worker(chunk)  # type: ignore[misc]


def _ordered_results(chunks: Iterator[Chunk], workers: int, init_args: tuple) -> Iterator[_Encoded]:
    if workers <= 1:
        enc = _Encoder(*init_args)
        for chunk in chunks:
            yield enc(chunk)
        return
    # fork starts workers fastest; the library imports no threaded runtime before this point. Not
    # multiprocessing.Pool: its exit stops workers with SIGTERM, which they ignore (see _init_worker); the
    # executor's shutdown sends each a sentinel instead.
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    executor = ProcessPoolExecutor(workers, ctx, initializer=_init_worker, initargs=(*init_args, True))
    try:
        pending: deque = deque()
        # A bounded look-ahead, so the reader never runs far ahead of the writer (memory stays flat).
        for chunk in chunks:
            pending.append(executor.submit(_work, chunk))
            if len(pending) >= 2 * workers + 2:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # after an error or an interrupt, only the chunks being encoded still finish
        executor.shutdown(wait=True, cancel_futures=True)


def _text_chunks(documents: Iterable[str], name: str) -> Iterator[Chunk]:
    items: list = []
    size_, nbytes, first = 0, 0, 1
    for n, doc in enumerate(documents, 1):
        if not items:
            first = n
        items.append({"text": doc})
        size_ += len(doc)
        nbytes += len(doc.encode())
        if size_ >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
            yield Chunk(name, first, "table", items, nbytes=nbytes)
            items, size_, nbytes = [], 0, 0
    if items:
        yield Chunk(name, first, "table", items, nbytes=nbytes)


def _skipped(stats: list[PreprocessStats], bad: BadRecords, detail: bool) -> str:
    empty = sum(s.skipped_empty for s in stats)
    parts = [f"{empty:,} empty document{'s' * (empty != 1)} skipped"] if empty else []
    if bad.count:
        parts.append(bad.summary() if detail else f"{bad.count:,} unreadable skipped")
    return ", ".join(parts)


def _write(
    chunks: Iterator[Chunk],
    prefixes: list[str],
    keys: list[str],
    tokenizer_path: str,
    append_eod: bool,
    workers: int,
    bad: BadRecords,
    progress: Progress,
    overwrite: bool,
) -> list[PreprocessStats]:
    dtype = dtype_for_vocab(load_tokenizer(tokenizer_path).vocab_size)
    stats = [PreprocessStats() for _ in prefixes]
    progress.notes = lambda: _skipped(stats, bad, detail=False)
    writers: list[IndexedDatasetWriter] = []
    try:
        for prefix in prefixes:
            writers.append(IndexedDatasetWriter(prefix, dtype, overwrite=overwrite))
        results = _ordered_results(chunks, workers, (tokenizer_path, keys, append_eod))
        with contextlib.closing(results):  # an error here stops the workers now, not at garbage collection
            for enc in results:
                bad.add(enc.path, enc.readable, enc.bad)
                for writer, s, (flat, lengths), empty in zip(
                    writers, stats, enc.per_key, enc.empty, strict=True
                ):
                    writer.add_documents(flat, lengths)
                    s.documents += len(lengths)
                    s.tokens += len(flat)
                    s.skipped_empty += empty
                progress.advance(
                    enc.nbytes,
                    documents=sum(len(lengths) for _, lengths in enc.per_key),
                    tokens=sum(len(flat) for flat, _ in enc.per_key),
                )
                progress.tick()
        bad.finish()
        for prefix, s in zip(prefixes, stats, strict=True):
            if s.documents == 0:
                skipped = _skipped(stats, bad, detail=True)
                raise DataError(
                    f"no documents for {prefix}: the input holds no text"
                    + (f" ({skipped})" if skipped else "")
                    + "; check --input and --json-keys"
                )
        for w in writers:  # every dataset complete before any appears under its name
            w.seal()
        for w in writers:
            w.publish()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for s in stats:
        s.seconds, s.skipped_bad = progress.elapsed, bad.count
    if progress.log:
        tokens = sum(s.tokens for s in stats)
        summary = (
            f"{progress.task} done in {duration(progress.elapsed)}: {size(progress.done)}, "
            f"{sum(s.documents for s in stats):,} documents, {tokens:,} tokens "
            f"({tokens / max(progress.elapsed, 1e-9):,.0f} tokens/s)"
        )
        skipped = _skipped(stats, bad, detail=True)
        progress.log(summary + (f"; {skipped}" if skipped else ""))
    return stats


def output_prefix_for(prefix: str, key: str) -> str:
    """Megatron's naming of the dataset written for one JSON key."""
    return f"{prefix}_{key}_document"


def preprocess_files(
    inputs: list[str],
    output_prefix: str,
    tokenizer_path: str,
    json_keys: list[str] | None = None,
    append_eod: bool = True,
    workers: int | None = None,
    on_bad_document: str = "skip",
    overwrite: bool = False,
    log: Log | None = say,
    log_interval: float = INTERVAL_S,
) -> dict[str, PreprocessStats]:
    """Tokenize input files into one indexed dataset per key, named `{output_prefix}_{key}_document`.

    Everything a user can get wrong up front (inputs, tokenizer, existing outputs) is checked before the
    first document is read.
    """
    keys = list(json_keys or ["text"])
    workers = workers if workers is not None else os.cpu_count() or 1
    prefixes = [output_prefix_for(output_prefix, k) for k in keys]
    total = check_inputs(list(inputs))
    if not os.path.exists(os.path.expanduser(tokenizer_path)):
        raise DataError(
            f"--tokenizer-model {tokenizer_path} does not exist; pass a SentencePiece .model file or a "
            "Hugging Face tokenizer directory (tools/train_tokenizer.py trains one)"
        )
    for prefix in prefixes:
        check_new_output(prefix, overwrite)
    bad = BadRecords(on_bad_document, log)
    progress = Progress(f"{tag('preprocess')} tokenizing", total, log, log_interval)
    stats = _write(
        read_chunks(list(inputs), keys),
        prefixes,
        keys,
        tokenizer_path,
        append_eod,
        workers,
        bad,
        progress,
        overwrite,
    )
    return dict(zip(prefixes, stats, strict=True))


def preprocess_documents(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer_path: str,
    append_eod: bool = True,
    workers: int = 1,
    log: Log | None = None,
    log_interval: float = INTERVAL_S,
    name: str = "<documents>",
) -> PreprocessStats:
    """Tokenize document strings into the indexed dataset `output_prefix` (progress as `name`)."""
    total = sum(len(d.encode()) for d in documents) if isinstance(documents, Sequence) else None
    progress = Progress(f"{tag('data')} tokenizing {name}", total, log, log_interval)
    stats = _write(
        _text_chunks(documents, name),
        [output_prefix],
        ["text"],
        tokenizer_path,
        append_eod,
        workers,
        BadRecords("error", log),
        progress,
        overwrite=False,
    )
    return stats[0]
