"""The indexed-dataset format: byte compatibility with megatron-core in both directions, and bad input."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from llmtrain.data import DataError, IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from llmtrain.data.indexed import bin_path, idx_path


def _random_docs(rng, n, vocab):
    return [rng.integers(0, vocab, size=rng.integers(0, 50)) for _ in range(n)]


@pytest.mark.parametrize("vocab", [200, 50_000, 100_000])
def test_written_by_us_read_by_megatron(tmp_path, mcore_indexed, vocab):
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, 40, vocab)
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, dtype_for_vocab(vocab)) as w:
        for d in docs:
            w.add_document(d)
    ref = mcore_indexed.IndexedDataset(prefix)
    assert len(ref) == len(docs)
    np.testing.assert_array_equal(ref.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ref[i], d)
        if len(d) > 3:
            np.testing.assert_array_equal(ref.get(i, offset=1, length=2), d[1:3])


def test_written_by_megatron_read_by_us(tmp_path, mcore_indexed):
    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "theirs")
    builder = mcore_indexed.IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16)
    sequences, doc_ends = [], [0]
    for _ in range(30):  # documents of several sequences, as Megatron's sentence-split preprocessing writes
        for _ in range(rng.integers(1, 4)):
            seq = rng.integers(0, 60_000, size=rng.integers(1, 40))
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
            sequences.append(seq)
        builder.end_document()
        doc_ends.append(len(sequences))
    builder.finalize(idx_path(prefix))
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.uint16 and len(ours) == len(sequences)
    np.testing.assert_array_equal(ours.document_indices, doc_ends)
    assert ours.num_documents == 30
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(ours[i], seq)
    np.testing.assert_array_equal(ours.tokens(0, len(sequences)), np.concatenate(sequences))


def test_dtype_for_vocab():
    assert dtype_for_vocab(256) == np.uint8
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.int32


@pytest.fixture
def small(tmp_path):
    prefix = str(tmp_path / "small")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in (5, 7, 3):
            w.add_document(np.arange(n))
    return prefix


def test_truncated_bin(small):
    with open(bin_path(small), "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match=r"small\.bin is truncated.*preprocess_data"):
        IndexedDataset(small)


def test_idx_not_matching_bin(small, tmp_path):
    with open(bin_path(small), "ab") as f:
        f.write(b"\0\0" * 4)
    with pytest.raises(DataError, match=r"small\.idx does not match .*small\.bin.*regenerate"):
        IndexedDataset(small)


def test_unknown_version(small):
    with open(idx_path(small), "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"small\.idx has format version 2.*version 1"):
        IndexedDataset(small)


def test_bad_magic_and_truncated_index(small):
    data = open(idx_path(small), "rb").read()
    open(idx_path(small), "wb").write(data[:-8])
    with pytest.raises(DataError, match=r"small\.idx is \d+ bytes.*truncated"):
        IndexedDataset(small)
    open(idx_path(small), "wb").write(b"NOTANIDX" + data[8:])
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(small)


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match=r"nothing\.idx does not exist.*preprocess_data"):
        IndexedDataset(tmp_path / "nothing")


def test_token_does_not_fit_dtype(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "x", np.uint8)
    with pytest.raises(DataError, match=r"token id 300 does not fit dtype uint8 of .*x\.bin"):
        w.add_document([1, 300])
    w.abort()
    assert not any(p.name.startswith("x.") for p in tmp_path.iterdir())


def test_interrupted_write_leaves_nothing(tmp_path):
    prefix = tmp_path / "y"
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("interrupted")
    assert not os.listdir(tmp_path)


def test_pickle_reopens(small):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(small)))
    np.testing.assert_array_equal(ds[1], np.arange(7))


def test_writer_keeps_an_existing_dataset_unless_overwrite(tmp_path):
    prefix = tmp_path / "d"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
    with pytest.raises(DataError, match=r"d\.bin already exists and is kept"):
        IndexedDatasetWriter(prefix, np.uint16)
    late = IndexedDatasetWriter(tmp_path / "e", np.uint16)  # another writer publishes e first
    late.add_document([4])
    with IndexedDatasetWriter(tmp_path / "e", np.uint16) as w:
        w.add_document([5, 6])
    with pytest.raises(DataError, match=r"e\.bin already exists and is kept"):
        late.finalize()
    late.abort()
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "e")[0], [5, 6])
    with IndexedDatasetWriter(prefix, np.uint16, overwrite=True) as w:
        w.add_document([7])
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], [7])
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "e.bin", "e.idx"]  # no temporary left


def test_published_files_have_the_permissions_of_a_plain_file(tmp_path):
    """Temporaries are renamed into place: they must not keep a private mode (mkstemp's 0600)."""
    with IndexedDatasetWriter(tmp_path / "p", np.uint8) as w:
        w.add_document([1])
    (tmp_path / "plain").write_bytes(b"")
    mode = os.stat(tmp_path / "plain").st_mode & 0o777
    assert {os.stat(tmp_path / n).st_mode & 0o777 for n in ("p.bin", "p.idx")} == {mode}


def test_two_writers_of_one_prefix_do_not_share_temporaries(tmp_path):
    a, b = IndexedDatasetWriter(tmp_path / "x", np.uint8), IndexedDatasetWriter(tmp_path / "x", np.uint8)
    a.add_document([1, 2])
    b.add_document([3])
    a.finalize()
    b.abort()  # b's abort must not remove what a wrote
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "x")[0], [1, 2])
