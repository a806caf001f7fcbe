"""Streaming readers of raw documents: JSONL (optionally gzipped), plain text, Parquet, saved `datasets`.

Readers yield chunks of records, never whole files, so memory stays flat for inputs larger than RAM.
JSON lines are yielded unparsed: the worker processes parse them, which keeps the reader off the
critical path.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmtrain.data.errors import DataError

CHUNK_BYTES = 1 << 18  # text per work item: amortises IPC, balances workers, bounds memory
CHUNK_RECORDS = 2048


@dataclass
class Chunk:
    """A run of consecutive records of one input file."""

    path: str
    first: int  # 1-based record (line) number of items[0], for error messages
    kind: str  # "json": items are raw JSON lines; "text": items are {key: text} dicts
    items: list
    lines: list[int] | None = None  # line number of each item when blank lines make them non-consecutive

    def where(self, n: int) -> str:
        """file:line of item n, for error messages."""
        return f"{self.path}:{self.lines[n] if self.lines else self.first + n}"


def input_kind(path: str) -> str:
    """Which reader handles `path`: jsonl, text, parquet or datasets."""
    p = Path(path)
    if p.is_dir():
        return "datasets"
    name = p.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".txt", ".text")):
        return "text"
    raise DataError(
        f"--input {path}: unknown format; use .jsonl/.json (one JSON object per line), .txt (one document "
        "per line), .parquet, or a directory saved with datasets.save_to_disk"
    )


def _open_text(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _chunks_of_lines(path: str, kind: str, key: str) -> Iterator[Chunk]:
    items: list = []
    lines: list[int] = []
    size = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue  # blank lines separate documents; they are not documents
            items.append(line if kind == "json" else {key: line})
            lines.append(lineno)
            size += len(line)
            if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
                yield Chunk(path, lines[0], kind, items, lines)
                items, lines, size = [], [], 0
    if items:
        yield Chunk(path, lines[0], kind, items, lines)


def _chunks_of_table(path: str, batches: Iterator[dict[str, list]], keys: list[str]) -> Iterator[Chunk]:
    record = 1
    for batch in batches:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise DataError(
                f"{path} has no column {missing[0]!r} (columns: {sorted(batch)}); "
                "pass --json-keys with one of them"
            )
        n = len(batch[keys[0]])
        for start in range(0, n, CHUNK_RECORDS):
            stop = min(n, start + CHUNK_RECORDS)
            items = [{k: batch[k][i] for k in keys} for i in range(start, stop)]
            yield Chunk(path, record + start, "text", items)
        record += n


def _parquet_batches(path: str, keys: list[str]) -> Iterator[dict[str, list]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = set(pf.schema_arrow.names)
    cols = [k for k in keys if k in names] or None
    for batch in pf.iter_batches(batch_size=CHUNK_RECORDS, columns=cols):
        yield batch.to_pydict()


def _datasets_batches(path: str) -> Iterator[dict[str, list]]:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path} is a DatasetDict without a 'train' split ({list(ds)}); save one split")
        ds = ds["train"]
    yield from ds.iter(batch_size=CHUNK_RECORDS)


def read_chunks(paths: list[str], keys: list[str]) -> Iterator[Chunk]:
    """Chunks of records from each input in turn (a text file's lines feed the first key)."""
    for path in paths:
        if not os.path.exists(path):
            raise DataError(f"--input {path} does not exist")
        kind = input_kind(path)
        if kind in ("jsonl", "text"):
            yield from _chunks_of_lines(path, "json" if kind == "jsonl" else "text", keys[0])
        elif kind == "parquet":
            yield from _chunks_of_table(path, _parquet_batches(path, keys), keys)
        else:
            yield from _chunks_of_table(path, _datasets_batches(path), keys)


def chunk_texts(chunk: Chunk, keys: list[str]) -> list[list[str]]:
    """The chunk's documents per key (parsing JSON lines); errors name the file, line and fix."""
    out: list[list[str]] = [[] for _ in keys]
    for n, item in enumerate(chunk.items):
        if chunk.kind == "json":
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise DataError(f"{chunk.where(n)}: invalid JSON ({e}); fix or remove the line") from e
        for col, key in zip(out, keys, strict=True):
            if not isinstance(item, dict) or key not in item:
                raise DataError(
                    f"{chunk.where(n)}: record has no key {key!r}; pass --json-keys naming the text field"
                )
            text = item[key]
            if not isinstance(text, str):
                raise DataError(f"{chunk.where(n)}: {key!r} is {type(text).__name__}, not text")
            col.append(text)
    return out


def iter_documents(paths: list[str], keys: list[str]) -> Iterator[str]:
    """Every document text of the inputs, key by key within a record, streaming."""
    for chunk in read_chunks(paths, keys):
        for texts in zip(*chunk_texts(chunk, keys), strict=True):
            yield from texts
