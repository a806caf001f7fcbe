"""Memory-mapped indexed datasets in Megatron-LM's binary format (`.bin` tokens + `.idx` index).

Index layout (little endian), the same as megatron-core's IndexedDataset, version 1:
    9 bytes magic b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 sequence count S
    | u64 document count D
    int32[S] sequence lengths | int64[S] byte offsets of the sequences in .bin | int64[D] document indices
    (optionally int8[S] sequence modes, written by Megatron's multimodal builder and ignored here)
Document indices start with 0 and each document appends the sequence count so far, so D = documents + 1.
The `.bin` file is the token ids of all sequences back to back in the index's dtype.
"""

from __future__ import annotations

import glob
import io
import mmap
import os
import re
import secrets
import struct
from pathlib import Path

import numpy as np

from llmtrain.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

# Megatron's dtype codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

REGENERATE = "regenerate it with tools/preprocess_data.py"


def idx_path(prefix: str | os.PathLike) -> str:
    """The index file of a dataset prefix."""
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    """The token file of a dataset prefix."""
    return f"{os.fspath(prefix)}.bin"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype of the format that holds ids 0..vocab_size-1."""
    for dtype in (np.uint8, np.uint16, np.int32, np.int64):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DataError(f"vocabulary of {vocab_size} tokens does not fit any token dtype of the indexed format")


def _missing(prefix: str) -> str:
    """Why there is no dataset at `prefix`, and the likely fix."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    if os.path.isfile(ipath) or os.path.isfile(bpath):
        there, missing = (ipath, bpath) if os.path.isfile(ipath) else (bpath, ipath)
        return (
            f"{missing} does not exist beside {there}: the preprocessing was interrupted or the copy is "
            f"incomplete; copy it too or {REGENERATE}"
        )
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx") and os.path.isfile(prefix):
        return f"{prefix} is a file; a dataset prefix names it without .bin/.idx: use {stem}"
    near = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
    if near:
        return (
            f"no dataset {ipath}; did you mean {near[0][: -len('.idx')]}? (preprocess_data names it by key)"
        )
    made = re.fullmatch(r"(.+)_([^_/]+)_document", prefix)
    how = f"--output-prefix {made[1]} --json-keys {made[2]}" if made else f"--output-prefix {prefix}"
    return (
        f"{ipath} does not exist; check the path or build the dataset with tools/preprocess_data.py {how} "
        "(it writes PREFIX_KEY_document.bin/.idx)"
    )


def _map(path: str) -> memoryview | bytes:
    """The file's bytes, memory-mapped read-only (plain ndarray views of it slice faster than np.memmap)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # mmap cannot map an empty file
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


class IndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair; item i is sequence i as a numpy array (a memmap slice).

    Opening validates the header and that the index describes exactly the bytes of the `.bin`, so a
    truncated or mismatched pair fails here with the file named rather than later with garbage tokens.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        if not (os.path.isfile(ipath) and os.path.isfile(bpath)):
            raise DataError(_missing(self.prefix))
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise DataError(f"{ipath} is not an indexed-dataset index (bad magic bytes); {REGENERATE}")
        _, version, code, nseq, ndoc = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(
                f"{ipath} has format version {version}, this reader knows version {VERSION}; "
                f"{REGENERATE} or convert it with the Megatron-LM release that wrote it"
            )
        if code not in DTYPE_CODES:
            raise DataError(f"{ipath} has unknown token dtype code {code}; {REGENERATE}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        body = 4 * nseq + 8 * nseq + 8 * ndoc
        if size not in (_HEADER.size + body, _HEADER.size + body + nseq):
            raise DataError(
                f"{ipath} is {size} bytes but its header announces {nseq} sequences and {ndoc} document "
                f"indices ({_HEADER.size + body} bytes); the index is truncated or corrupt: {REGENERATE}"
            )
        buf = _map(ipath)
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(buf, np.int32, nseq, off)
        self.sequence_pointers = np.frombuffer(buf, np.int64, nseq, off + 4 * nseq)
        self.document_indices = np.frombuffer(buf, np.int64, ndoc, off + 12 * nseq)
        self._check(ipath, bpath)
        self._tokens = np.frombuffer(_map(bpath), dtype=self.dtype)
        # Sequences are stored back to back, so token offsets are byte offsets / itemsize.
        self._starts = self.sequence_pointers // self.dtype.itemsize

    def _check(self, ipath: str, bpath: str) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        item = self.dtype.itemsize
        expected = int(pointers[-1]) + int(lengths[-1]) * item if len(lengths) else 0
        actual = os.path.getsize(bpath)
        if actual < expected:
            raise DataError(
                f"{bpath} is truncated: {actual} bytes, but {ipath} indexes {expected} bytes; "
                f"the copy or the preprocessing was interrupted: {REGENERATE}"
            )
        if actual > expected:
            raise DataError(
                f"{ipath} does not match {bpath}: the index covers {expected} bytes but the .bin has "
                f"{actual}; "
                f"they come from different runs: {REGENERATE} (both files together)"
            )
        if len(lengths) and (
            pointers[0] != 0
            or (lengths < 0).any()
            or not np.array_equal(np.diff(pointers), lengths[:-1].astype(np.int64) * item)
        ):
            raise DataError(f"{ipath} has sequence offsets inconsistent with its lengths; {REGENERATE}")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
            raise DataError(f"{ipath} has invalid document indices; {REGENERATE}")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}  # memmaps are reopened in the receiving process, not copied

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        # numpy scalars index directly; converting them with int() would double the cost of a read
        start = self._starts[i]
        return self._tokens[start : start + self.sequence_lengths[i]]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (to its end when length is None)."""
        start = self._starts[i] + offset
        if length is None:
            length = self.sequence_lengths[i] - offset
        return self._tokens[start : start + length]

    def tokens(self, first: int, last: int) -> np.ndarray:
        """All tokens of sequences first..last-1 as one contiguous view."""
        if last <= first:
            return self._tokens[:0]
        end = int(self._starts[last - 1]) + int(self.sequence_lengths[last - 1])
        return self._tokens[int(self._starts[first]) : end]

    @property
    def num_documents(self) -> int:
        """Number of documents (groups of sequences)."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens in the `.bin`."""
        return int(self.sequence_lengths.sum(dtype=np.int64))


def check_new_output(prefix: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse to write over an existing dataset unless `overwrite`: a user's data is never lost silently."""
    for path in (bin_path(prefix), idx_path(prefix)):
        if os.path.exists(path) and not overwrite:
            raise DataError(
                f"{path} already exists and is kept; write to another prefix, move it away, or replace it "
                "with --overwrite"
            )


def _temporary(path: str) -> tuple[io.BufferedWriter, str]:
    """A new file beside `path` with a unique name (two writers of one prefix never share a temporary).

    Created with the umask's permissions, as the published file should have (mkstemp would make it 0600).
    """
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    return os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb"), tmp


def _sync(f: io.BufferedWriter) -> None:
    f.flush()
    os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible


class IndexedDatasetWriter:
    """Appends documents to a new `.bin`/`.idx` pair; files appear under their names only on `finalize`.

    The data goes to uniquely named temporary files beside the outputs. `finalize` is `seal` (write and
    sync the index) then `publish` (rename both into place); a caller writing several datasets seals them
    all before publishing any. Use as a context manager: an exception discards the partial files, so an
    interrupted run never leaves a pair that looks complete. An existing pair is replaced only with
    `overwrite=True`.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type, overwrite: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self.overwrite = overwrite
        if self.dtype not in _CODE_OF:
            raise DataError(
                f"token dtype {self.dtype} is not one of the format's {sorted(map(str, _CODE_OF))}"
            )
        check_new_output(self.prefix, overwrite)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin, self._tmp_bin = _temporary(bin_path(self.prefix))
        self._tmp_idx: str | None = None
        self._lengths: list[np.ndarray] = []
        self._max = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None
        self._sealed = self._finished = False

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document made of one sequence."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append several one-sequence documents given as their concatenated tokens and their lengths."""
        if len(tokens) and self._max is not None and (int(tokens.max()) > self._max or int(tokens.min()) < 0):
            raise DataError(
                f"token id {int(tokens.max())} does not fit dtype {self.dtype} of {bin_path(self.prefix)}; "
                "the tokenizer's vocabulary is larger than the dtype allows: write with a wider dtype "
                "(dtype_for_vocab(vocab_size))"
            )
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))

    def seal(self) -> None:
        """Finish the `.bin` and write the `.idx`, both still under their temporary names, synced to disk."""
        if self._sealed:
            return
        self._sealed = True
        with self._bin:
            _sync(self._bin)
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise DataError(
                f"a document of {int(lengths.max())} tokens exceeds the format's int32 length field"
            )
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.arange(len(lengths) + 1, dtype=np.int64)
        f, self._tmp_idx = _temporary(idx_path(self.prefix))
        with f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())
            _sync(f)

    def publish(self) -> None:
        """Rename the sealed pair into place: the `.bin` first, so a visible `.idx` means complete.

        When replacing a dataset (overwrite=True) the old `.idx` goes first, so that no moment shows the
        new `.bin` beside the old index.
        """
        if self._finished:
            return
        self.seal()
        check_new_output(self.prefix, self.overwrite)  # someone may have written it since we started
        if self.overwrite and os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._finished = True

    def finalize(self) -> None:
        """Seal and publish."""
        self.seal()
        self.publish()

    def abort(self) -> None:
        """Discard what is not yet published."""
        if self._finished:
            return
        self._finished = True
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if path and os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
