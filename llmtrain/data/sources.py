"""Streaming readers of raw documents: JSONL (optionally gzipped), plain text, Parquet, saved `datasets`.

Readers yield chunks of records, never whole files, so memory stays flat for inputs larger than RAM.
Lines are yielded as raw bytes: the worker processes decode and parse them, which keeps the reader off
the critical path and lets a record that is not UTF-8 be named by its line like any other bad record.
Each chunk says how many bytes of its input file it covers, so progress can be shown as a share of the
inputs' size on disk.

A record that cannot be read (not UTF-8, invalid JSON, a missing key, a value that is not a string) does
not stop the run by default: `BadRecords` counts it and names the first few, because one damaged line of
a large corpus should not throw hours of work away. It stops at once with `on_bad_document="error"`, and
in any case when an input gives many unreadable records before a single readable one, which is a wrong
--json-keys or format rather than damage.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from llmtrain.data.errors import DataError
from llmtrain.data.progress import Log, Progress, tag

CHUNK_BYTES = 1 << 18  # text per work item: amortises IPC, balances workers, bounds memory
CHUNK_RECORDS = 2048
BAD_DOCUMENT_POLICIES = ("skip", "error")
NAMED_BAD = 5
"""Unreadable records named one by one (the rest are counted): enough to see a pattern, not a flood."""
KEY_OPTION, SKIP_OPTION = "--json-keys", "--on-bad-document skip"
"""How messages name the key setting and the skip policy: preprocess_data's flags by default."""
SYSTEMATIC_BAD = 100
"""Unreadable records an input may give before its first readable one until the run stops as misconfigured."""


@dataclass
class Chunk:
    """A run of consecutive records of one input file."""

    path: str
    first: int  # 1-based record (line) number of items[0], for error messages
    kind: str  # "json": raw JSON lines (bytes); "text": raw text lines (bytes); "table": {key: value} dicts
    items: list
    lines: list[int] | None = None  # line number of each item when blank lines make them non-consecutive
    nbytes: float = 0.0  # bytes of the input file this chunk covers (its share of a table), for progress

    def where(self, n: int) -> str:
        """file:line of item n, for error messages."""
        return f"{self.path}:{self.lines[n] if self.lines else self.first + n}"


class BadRecord(NamedTuple):
    """An unreadable record: where it is, what is wrong, and how to fix it."""

    where: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


class _Unreadable(Exception):
    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def input_kind(path: str) -> str:
    """Which reader handles `path`: jsonl, text, parquet or datasets."""
    p = Path(path)
    if p.is_dir():
        if not ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            raise DataError(
                f"--input {path} is a directory but not a dataset saved with datasets' save_to_disk (it has "
                "no state.json or dataset_dict.json); pass that directory, or the data files themselves"
            )
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


def input_size(path: str) -> int:
    """Bytes of an input on disk (a directory's files summed)."""
    if os.path.isdir(path):
        return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return os.path.getsize(path)


def check_inputs(paths: list[str]) -> int:
    """Check that every input exists, is readable and has a known format (before any work); the total size."""
    if not paths:
        raise DataError("no --input given; pass one or more .jsonl, .txt, .parquet files or dataset folders")
    for path in paths:
        if not os.path.exists(path):
            raise DataError(f"--input {path} does not exist; check the path (relative to {os.getcwd()})")
        if not os.access(path, os.R_OK):
            raise DataError(f"--input {path} is not readable by this user; fix its permissions")
        input_kind(path)
    return sum(input_size(p) for p in paths)


def _chunks_of_lines(path: str, kind: str) -> Iterator[Chunk]:
    items: list[bytes] = []
    lines: list[int] = []
    size = reported = lineno = 0
    try:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.lower().endswith(".gz") else raw
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue  # blank lines separate documents; they are not documents
                line = line[:-1] if line.endswith(b"\n") else line
                items.append(line[:-1] if line.endswith(b"\r") else line)
                lines.append(lineno)
                size += len(line)
                if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
                    position = raw.tell()  # of the file on disk: compressed bytes for .gz
                    yield Chunk(path, lines[0], kind, items, lines, position - reported)
                    items, lines, size, reported = [], [], 0, position
            position = raw.tell()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(
            f"{path}: cannot read past line {lineno} ({e}); the file is truncated or corrupt: "
            "re-create or re-download it"
        ) from e
    if items or position > reported:
        yield Chunk(path, lines[0] if lines else lineno, kind, items, lines, position - reported)


def chunks_of_table(
    path: str,
    batches: Iterator[dict[str, list]],
    keys: list[str],
    rows: int,
    nbytes: int,
    key_option: str = KEY_OPTION,
) -> Iterator[Chunk]:
    record = 1
    for batch in batches:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise DataError(
                f"{path} has no column {missing[0]!r} (columns: {sorted(batch)}); "
                f"pass {key_option} with one of them"
            )
        n = len(batch[keys[0]])
        for start in range(0, n, CHUNK_RECORDS):
            stop = min(n, start + CHUNK_RECORDS)
            items = [{k: batch[k][i] for k in keys} for i in range(start, stop)]
            yield Chunk(path, record + start, "table", items, nbytes=nbytes * (stop - start) / max(rows, 1))
        record += n


def _parquet_chunks(path: str, keys: list[str], key_option: str) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}); re-create or re-download it") from e
    names = set(pf.schema_arrow.names)
    cols = [k for k in keys if k in names] or None
    batches = (b.to_pydict() for b in pf.iter_batches(batch_size=CHUNK_RECORDS, columns=cols))
    rows, nbytes = pf.metadata.num_rows, os.path.getsize(path)
    yield from chunks_of_table(path, batches, keys, rows, nbytes, key_option)


def _datasets_chunks(path: str, keys: list[str], key_option: str) -> Iterator[Chunk]:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path} is a DatasetDict without a 'train' split ({list(ds)}); save one split")
        ds = ds["train"]
    batches = ds.iter(batch_size=CHUNK_RECORDS)
    yield from chunks_of_table(path, batches, keys, len(ds), input_size(path), key_option)


def read_chunks(paths: list[str], keys: list[str], key_option: str = KEY_OPTION) -> Iterator[Chunk]:
    """Chunks of records from each input in turn (a text file's lines feed the first key); a missing
    column is named with `key_option`, the setting that chooses it."""
    for path in paths:
        kind = input_kind(path)
        if kind in ("jsonl", "text"):
            yield from _chunks_of_lines(path, "json" if kind == "jsonl" else "text")
        elif kind == "parquet":
            yield from _parquet_chunks(path, keys, key_option)
        else:
            yield from _datasets_chunks(path, keys, key_option)


def _value_type(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _record(item: bytes | dict, kind: str, keys: list[str], key_option: str) -> dict:
    if isinstance(item, bytes):
        try:
            line = item.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Unreadable(
                f"not UTF-8 text (byte {item[e.start]:#04x} at byte {e.start + 1} of the line)",
                "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)",
            ) from None
        if kind == "text":
            return {keys[0]: line}
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise _Unreadable(f"invalid JSON ({e})", "fix or remove the line") from None
        if not isinstance(item, dict):
            raise _Unreadable(f"a JSON {_value_type(item)}, not an object", "make each line one JSON object")
    for key in keys:
        if key not in item:
            raise _Unreadable(
                f"record has no key {key!r} (it has {sorted(item)[:8]})",
                f"pass {key_option} naming the text field",
            )
        if not isinstance(item[key], str):
            raise _Unreadable(
                f"{key!r} is {_value_type(item[key])}, not a string", "make it a string or drop the record"
            )
    return item


def parse_records(
    chunk: Chunk, keys: list[str], key_option: str = KEY_OPTION
) -> tuple[list[tuple[int, dict]], list[BadRecord]]:
    """(position in the chunk, record) of each readable record, and each unreadable record, in order."""
    readable: list[tuple[int, dict]] = []
    bad: list[BadRecord] = []
    for n, item in enumerate(chunk.items):
        try:
            readable.append((n, _record(item, chunk.kind, keys, key_option)))
        except _Unreadable as e:
            bad.append(BadRecord(chunk.where(n), e.why, e.fix))
    return readable, bad


def parse_chunk(chunk: Chunk, keys: list[str]) -> tuple[list[list[str]], list[BadRecord]]:
    """The texts per key of the chunk's readable records, and each unreadable record, in order.

    A record missing one of several keys is unreadable as a whole, so the datasets of all keys keep the
    same records.
    """
    readable, bad = parse_records(chunk, keys)
    return [[record[key] for _, record in readable] for key in keys], bad


class BadRecords:
    """The unreadable records of a run under its policy (see the module's docstring).

    `add` is called for each chunk in input order, from one process; under 'skip', the first NAMED_BAD
    records are logged as they come and `summary()` gives the count and the first one.
    """

    def __init__(
        self,
        policy: str = "skip",
        log: Log | None = None,
        log_tag: str = "preprocess",
        options: tuple[str, str] = (KEY_OPTION, SKIP_OPTION),
    ) -> None:
        if policy not in BAD_DOCUMENT_POLICIES:
            raise DataError(f"on_bad_document must be one of {BAD_DOCUMENT_POLICIES}; got {policy!r}")
        self.policy, self.log, self.tag = policy, log, log_tag
        self.key_option, self.skip_option = options
        self.count = 0
        self.first: BadRecord | None = None
        self._input: str | None = None
        self._readable = self._bad = 0
        self._input_first: BadRecord | None = None

    def add(self, path: str, readable: int, bad: list[BadRecord]) -> None:
        """Account for one chunk of `path`: `readable` records read, `bad` not; raise when the policy says."""
        if path != self._input:
            self.finish()
            self._input, self._readable, self._bad, self._input_first = path, 0, 0, None
        if bad and self.policy == "error":
            b = bad[0]
            raise DataError(f"{b}; {b.fix}, or pass {self.skip_option} to skip unreadable records")
        self._readable += readable
        self._bad += len(bad)
        self._input_first = self._input_first or (bad[0] if bad else None)
        if not self._readable and self._bad >= SYSTEMATIC_BAD:
            self._stop_misconfigured(f"none of the first {self._bad} records")
        for b in bad:
            self.count += 1
            self.first = self.first or b
            if self.log and self.count <= NAMED_BAD:
                more = (
                    " (further unreadable records are counted, not named)" if self.count == NAMED_BAD else ""
                )
                self.log(f"{tag(self.tag)} skipping {b}{more}")

    def finish(self) -> None:
        """The current input has ended: stop if it gave unreadable records and not one readable."""
        if self._input is not None and not self._readable and self._bad:
            self._stop_misconfigured(f"none of the {self._bad} records")

    def _stop_misconfigured(self, which: str) -> None:
        b = self._input_first
        raise DataError(
            f"{which} of {self._input} is readable (first: {b}); its format or {self.key_option} is wrong, "
            "not a "
            f"few records damaged: {b.fix}"
        )

    def summary(self) -> str:
        """'3 unreadable records skipped (first: file:line: why)', or '' when there were none."""
        if not self.count:
            return ""
        noun = "record" if self.count == 1 else "records"
        return f"{self.count:,} unreadable {noun} skipped (first: {self.first})"


def iter_documents(
    paths: list[str], keys: list[str], bad: BadRecords, progress: Progress | None = None
) -> Iterator[str]:
    """Every document text of the inputs, key by key within a record, streaming; unreadable records go
    to `bad`, and each chunk read advances `progress` by its bytes on disk."""
    for chunk in read_chunks(paths, keys):
        texts, unreadable = parse_chunk(chunk, keys)
        bad.add(chunk.path, len(texts[0]), unreadable)
        if progress is not None:
            progress.advance(chunk.nbytes, documents=sum(len(t) for t in texts))
        for record in zip(*texts, strict=True):
            yield from record
    bad.finish()
