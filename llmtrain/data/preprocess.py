"""Tokenize raw documents into indexed datasets with worker processes, streaming, in input order."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from llmtrain.data.errors import DataError
from llmtrain.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from llmtrain.data.sources import CHUNK_BYTES, CHUNK_RECORDS, Chunk, chunk_texts, read_chunks
from llmtrain.data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer


@dataclass
class PreprocessStats:
    """What one preprocessing run wrote."""

    documents: int = 0
    tokens: int = 0
    skipped_empty: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class _Encoder:
    """Per-process tokenization state (one per worker, created by the pool initializer)."""

    def __init__(
        self, tokenizer_path: str, keys: list[str], append_eod: bool, skip_empty: bool, in_pool: bool = False
    ) -> None:
        self.tok: Tokenizer = load_tokenizer(tokenizer_path)
        if in_pool and isinstance(self.tok, SentencePieceTokenizer):
            self.tok.num_threads = (
                1  # the pool already runs one process per core; threads would oversubscribe
            )
        self.keys, self.append_eod, self.skip_empty = keys, append_eod, skip_empty
        self.dtype = dtype_for_vocab(self.tok.vocab_size)

    def __call__(self, chunk: Chunk) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        per_key, skipped = [], 0
        for texts in chunk_texts(chunk, self.keys):
            encoded = self.tok.encode_batch(texts)
            kept = []
            for n, ids in enumerate(encoded):
                if not ids:
                    if not self.skip_empty:
                        raise DataError(
                            f"{chunk.where(n)}: empty document (no tokens); remove it or pass "
                            "--skip-empty to drop empty documents"
                        )
                    skipped += 1
                    continue
                if self.append_eod:
                    ids.append(self.tok.eod_id)
                kept.append(ids)
            lengths = np.fromiter((len(x) for x in kept), dtype=np.int64, count=len(kept))
            flat = np.fromiter(
                itertools.chain.from_iterable(kept), dtype=self.dtype, count=int(lengths.sum())
            )
            per_key.append((flat, lengths))
        return per_key, skipped


_worker: _Encoder | None = None


def _init_worker(*args) -> None:
    global _worker
    _worker = _Encoder(*args)


def _work(chunk: Chunk):
    try:
        return _worker(chunk)  # type: ignore[misc]
    except DataError as e:  # errors travel back as values: exceptions with context pickle poorly
        return e.args[0]


def _ordered_results(
    chunks: Iterator[Chunk], workers: int, init_args: tuple
) -> Iterator[tuple[list[tuple[np.ndarray, np.ndarray]], int]]:
    if workers <= 1:
        enc = _Encoder(*init_args)
        for chunk in chunks:
            yield enc(chunk)
        return
    # fork starts workers fastest; the library imports no threaded runtime before this point.
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(*init_args, True)) as pool:
        pending: deque = deque()
        # Bounded look-ahead instead of pool.imap, whose feeder thread reads the whole input into memory.
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * workers + 2:
                yield _unwrap(pending.popleft().get())
        while pending:
            yield _unwrap(pending.popleft().get())


def _unwrap(result):
    if isinstance(result, str):
        raise DataError(result)
    return result


def _text_chunks(documents: Iterable[str], name: str) -> Iterator[Chunk]:
    items: list = []
    size, first = 0, 1
    for n, doc in enumerate(documents, 1):
        if not items:
            first = n
        items.append({"text": doc})
        size += len(doc)
        if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
            yield Chunk(name, first, "text", items)
            items, size = [], 0
    if items:
        yield Chunk(name, first, "text", items)


def _write(
    chunks: Iterator[Chunk],
    prefixes: list[str],
    keys: list[str],
    tokenizer_path: str,
    append_eod: bool,
    workers: int,
    skip_empty: bool,
    log: Callable[[str], None] | None,
    log_interval: float,
) -> PreprocessStats:
    dtype = dtype_for_vocab(load_tokenizer(tokenizer_path).vocab_size)
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    stats = PreprocessStats()
    start = last_log = time.perf_counter()
    try:
        for per_key, skipped in _ordered_results(
            chunks, workers, (tokenizer_path, keys, append_eod, skip_empty)
        ):
            for writer, (flat, lengths) in zip(writers, per_key, strict=True):
                writer.add_documents(flat, lengths)
            stats.documents += len(per_key[0][1])
            stats.tokens += sum(len(flat) for flat, _ in per_key)
            stats.skipped_empty += skipped
            now = time.perf_counter()
            if log and now - last_log >= log_interval:
                last_log = now
                log(_progress(stats, now - start))
        if stats.documents == 0:
            raise DataError(
                f"no documents found for {prefixes[0]}: the input is empty or every document is empty"
            )
        for w in writers:
            w.finalize()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    stats.seconds = time.perf_counter() - start
    if log:
        log(
            _progress(stats, stats.seconds)
            + (f", {stats.skipped_empty} empty skipped" if stats.skipped_empty else "")
        )
    return stats


def _progress(stats: PreprocessStats, seconds: float) -> str:
    return (
        f"[preprocess] {stats.documents:,} docs, {stats.tokens:,} tokens, "
        f"{stats.tokens / max(seconds, 1e-9):,.0f} tokens/s"
    )


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
    skip_empty: bool = False,
    log: Callable[[str], None] | None = print,
    log_interval: float = 5.0,
) -> dict[str, PreprocessStats]:
    """Tokenize input files into one indexed dataset per key, named `{output_prefix}_{key}_document`."""
    keys = list(json_keys or ["text"])
    workers = workers if workers is not None else os.cpu_count() or 1
    prefixes = [output_prefix_for(output_prefix, k) for k in keys]
    stats = _write(
        read_chunks(list(inputs), keys),
        prefixes,
        keys,
        tokenizer_path,
        append_eod,
        workers,
        skip_empty,
        log,
        log_interval,
    )
    return dict.fromkeys(prefixes, stats)


def preprocess_documents(
    documents: Iterable[str],
    output_prefix: str,
    tokenizer_path: str,
    append_eod: bool = True,
    workers: int = 1,
    skip_empty: bool = True,
    log: Callable[[str], None] | None = None,
    name: str = "<documents>",
) -> PreprocessStats:
    """Tokenize an iterable of document strings into the indexed dataset `output_prefix`."""
    return _write(
        _text_chunks(documents, name),
        [output_prefix],
        ["text"],
        tokenizer_path,
        append_eod,
        workers,
        skip_empty,
        log,
        5.0,
    )
