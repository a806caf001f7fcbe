"""SentencePiece training as a task a user can follow: what it trains on, about how long, and signs of life.

SentencePiece first pulls every document through the iterator it is given (there progress can be
counted), then trains in one long native call that says nothing (its own log is off unless asked). That
call releases the GIL, so a heartbeat thread reports how long it has run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from llmtrain.data.progress import INTERVAL_S, Log, Progress, duration, heartbeat, say, size

# Seconds per MB of training text with train_sentencepiece's 2 threads, measured on Python sources on a
# 2-core x86 machine: BPE 0.21-0.27 s/MB (3-12 MB, 2k-32k pieces), unigram 1.1-3.9 s/MB and superlinear.
# Only a rough guide, said as such: the heartbeat reports the real time.
SECONDS_PER_MB = {"bpe": 0.3, "unigram": 2.5}


def estimate_seconds(model_type: str, text_bytes: float, lines: int, input_sentence_size: int) -> float:
    """Rough training time of SentencePiece on this text (it samples input_sentence_size lines of more)."""
    sampled = text_bytes * min(1.0, input_sentence_size / max(lines, 1))
    return SECONDS_PER_MB[model_type] * sampled / 1e6


class _Feed:
    """The documents as SentencePiece pulls them, counted; calls `on_end` once the last has been pulled."""

    def __init__(self, documents: Iterable[str], on_end: Callable[[], None]) -> None:
        self.documents, self.text_bytes, self.lines = 0, 0, 0
        self.ended_at: float | None = None
        self._source, self._on_end = documents, on_end

    def __iter__(self) -> Iterator[str]:
        for doc in self._source:
            self.documents += 1
            self.text_bytes += len(doc.encode())
            self.lines += doc.count("\n") + 1
            yield doc
        self.ended_at = time.monotonic()
        self._on_end()


def train_sentencepiece_reported(
    documents: Iterable[str],
    output: str | os.PathLike,
    vocab_size: int,
    *,
    log_tag: str,
    reading: Progress | None = None,
    log: Log | None = say,
    interval: float = INTERVAL_S,
    model_type: str = "bpe",
    input_sentence_size: int = 1_000_000,
    **options,
) -> Path:
    """llmtrain.data.tokenizer.train_sentencepiece, reporting as it goes (`options` are passed on).

    While the documents are read: a line every `interval` seconds, `reading`'s when given (the caller's
    source advances it, knowing the inputs' size), else a count of documents. When all are read: what
    SentencePiece trains on and roughly how long that takes. While it trains: the time so far, every
    `interval` seconds. At the end: how long it took.
    """
    from llmtrain.data.tokenizer import train_sentencepiece

    start = time.monotonic()
    last_line = [start]

    def announce() -> None:
        if log is None:
            return
        estimate = estimate_seconds(model_type, feed.text_bytes, feed.lines, input_sentence_size)
        sampled = "" if feed.lines <= input_sentence_size else f" ({input_sentence_size:,} lines sampled)"
        how_long = f", roughly {duration(estimate)}" if estimate >= 1 else " in under a second"
        log(
            f"{log_tag} read {feed.documents:,} documents ({size(feed.text_bytes)} of text, "
            f"{feed.lines:,} lines){sampled}; SentencePiece now trains a {vocab_size:,}-piece {model_type} "
            f"tokenizer on them{how_long}"
        )
        last_line[0] = time.monotonic()

    def beat() -> None:
        now = time.monotonic()
        if log is None or now - last_line[0] < interval:
            return
        last_line[0] = now
        if feed.ended_at is not None:
            log(f"{log_tag} SentencePiece still training: {duration(now - feed.ended_at)} so far")
        elif reading is not None:
            log(reading.line())
        else:
            log(
                f"{log_tag} reading documents for the tokenizer: {feed.documents:,} ({size(feed.text_bytes)})"
            )

    feed = _Feed(documents, announce)
    with heartbeat(beat, period=min(0.5, max(interval, 0.05))):
        path = train_sentencepiece(
            feed,
            output,
            vocab_size,
            model_type=model_type,
            input_sentence_size=input_sentence_size,
            **options,
        )
    if log is not None:
        now = time.monotonic()
        log(f"{log_tag} tokenizer trained in {duration(now - (feed.ended_at or start))}")
    return path


def train_tokenizer_files(
    inputs: list[str],
    model_prefix: str,
    vocab_size: int,
    *,
    json_keys: list[str] | None = None,
    model_type: str = "bpe",
    user_defined_symbols: Iterable[str] = (),
    input_sentence_size: int = 1_000_000,
    on_bad_document: str = "skip",
    overwrite: bool = False,
    verbose: bool = False,
    log: Log | None = say,
    interval: float = INTERVAL_S,
) -> Path:
    """Train a SentencePiece tokenizer on input files (as preprocess_files reads them); writes PREFIX.model.

    Inputs and the output are checked before anything is read; unreadable records follow `on_bad_document`
    as in preprocessing (see llmtrain.data.sources), and the summary counts them.
    """
    from llmtrain.data.errors import DataError
    from llmtrain.data.progress import tag
    from llmtrain.data.sources import BadRecords, check_inputs, iter_documents

    output = Path(model_prefix + ".model")
    total = check_inputs(list(inputs))
    if output.exists() and not overwrite:
        raise DataError(
            f"{output} already exists; choose another --model-prefix, move it away, or pass --overwrite"
        )
    log_tag = tag("train_tokenizer")
    bad = BadRecords(on_bad_document, log, "train_tokenizer")
    reading = Progress(f"{log_tag} reading", total, log, interval)
    path = train_sentencepiece_reported(
        iter_documents(list(inputs), list(json_keys or ["text"]), bad, reading),
        output,
        vocab_size,
        log_tag=log_tag,
        reading=reading,
        log=log,
        interval=interval,
        model_type=model_type,
        input_sentence_size=input_sentence_size,
        user_defined_symbols=user_defined_symbols,
        verbose=verbose,
    )
    if log is not None and bad.count:
        log(f"{log_tag} {bad.summary()}")
    return path
