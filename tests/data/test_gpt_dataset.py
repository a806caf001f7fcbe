"""GPT sampling: windows over the shuffled document stream as the module docstring defines them, blending."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmtrain.data import (
    BlendedDataset,
    DataError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    split_ranges,
)
from llmtrain.data.gpt_dataset import blend_indices


def _write(prefix, lengths):
    """Documents whose tokens encode (document, position): token = 1000*doc + position."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(1000 * d + np.arange(n))
    return IndexedDataset(prefix)


def _by_definition(lengths, first, last, seq, seed, count):
    """The documented sample order, computed the slow obvious way."""
    docs = np.arange(first, last)
    total = int(sum(lengths[first:last]))
    stream, epoch = [], 0
    while len(stream) < count * seq + seq + 1 + total:
        order = np.random.Generator(np.random.PCG64([seed, epoch, 0])).permutation(len(docs))
        for d in docs[order]:
            stream.extend(1000 * d + np.arange(lengths[d]))
        epoch += 1
    shuffled, block = [], 0
    while len(shuffled) < count:
        lo, hi = math.ceil(block * total / seq), math.ceil((block + 1) * total / seq)
        perm = np.random.Generator(np.random.PCG64([seed, block, 1])).permutation(hi - lo)
        shuffled.extend(lo + perm)
        block += 1
    return [np.array(stream[s * seq : s * seq + seq + 1]) for s in shuffled[:count]]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda x: sum(x) > 0),
    seq=st.integers(1, 30),
    seed=st.integers(0, 2**31),
    count=st.integers(1, 60),
)
def test_samples_follow_the_definition(tmp_path_factory, lengths, seq, seed, count):
    ds = GPTDataset(_write(tmp_path_factory.mktemp("g") / "d", lengths), (0, len(lengths)), seq, seed)
    ds.prepare(count)
    expected = _by_definition(np.array(lengths), 0, len(lengths), seq, seed, count)
    for i in range(count):
        np.testing.assert_array_equal(ds[i], expected[i])


def test_windows_tile_each_epoch_and_cross_documents(tmp_path):
    lengths = [7, 0, 13, 5, 21, 1, 9]
    ds = GPTDataset(_write(tmp_path / "d", lengths), (1, 6), seq_length=4, seed=3)
    total = sum(lengths[1:6])
    first_block = math.ceil(total / 4)
    ds.prepare(first_block)
    heads = np.concatenate([ds[i][:4] for i in range(first_block)])
    # The first block's windows start every 4 tokens from the start of epoch 0, so together they hold
    # each token of the split once, plus fewer than 4 tokens of epoch 1.
    expected = {1000 * d + p for d in range(1, 6) for p in range(lengths[d])}
    assert set(heads.tolist()) == expected and len(heads) - total < 4
    assert all(s.dtype == np.int64 and len(s) == 5 for s in (ds[i] for i in range(first_block)))
    assert not any(1000 * 6 <= t for i in range(first_block) for t in ds[i])  # document 6 is out of range
    crossing = [s for s in (ds[i] for i in range(first_block)) if len(set(s // 1000)) > 1]
    assert crossing, "windows must cross document boundaries"


def test_growing_keeps_the_prefix_and_cache_is_reused(tmp_path, monkeypatch):
    indexed = _write(tmp_path / "d", [30, 17, 44, 9])
    ds = GPTDataset(indexed, (0, 4), 8, seed=1, cache_dir=tmp_path / "cache")
    ds.prepare(5)
    head = [ds[i] for i in range(5)]
    ds.prepare(100)  # several epochs
    assert ds.num_samples >= 100
    for i in range(5):
        np.testing.assert_array_equal(ds[i], head[i])
    assert len([p for p in (tmp_path / "cache").glob("gpt-*") if p.is_dir()]) == 2
    monkeypatch.setattr(GPTDataset, "_build", lambda *a: pytest.fail("index rebuilt despite the cache"))
    again = GPTDataset(indexed, (0, 4), 8, seed=1, cache_dir=tmp_path / "cache")
    again.prepare(5)
    np.testing.assert_array_equal(again[4], head[4])
    other_seed = GPTDataset(indexed, (0, 4), 8, seed=2)
    monkeypatch.undo()
    other_seed.prepare(5)
    assert any(not np.array_equal(other_seed[i], head[i]) for i in range(5))


def test_split_ranges():
    assert split_ranges(100, "98,2,0") == [(0, 98), (98, 100), (100, 100)]
    ranges = split_ranges(10, "1,1,1")
    assert ranges[0][0] == 0 and ranges[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(DataError, match="data.split"):
        split_ranges(10, "1,1")


def test_empty_split_is_explained(tmp_path):
    indexed = _write(tmp_path / "d", [5, 0])
    with pytest.raises(DataError, match=r"valid split of .*d \(documents 1..2\) has no tokens.*data.split"):
        GPTDataset(indexed, (1, 2), 4, 0, split_name="valid")


def test_blend_follows_weights_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    which, nth = blend_indices(weights, 1000)
    for d, w in enumerate(weights):
        taken = np.cumsum(which == d)
        assert np.all(np.abs(taken - w * np.arange(1, 1001)) < 1.0)  # never more than one sample off
        np.testing.assert_array_equal(nth[which == d], np.arange((which == d).sum()))


def test_blended_dataset_reads_components(tmp_path):
    a = GPTDataset(_write(tmp_path / "a", [20, 30]), (0, 2), 4, 0)
    b = GPTDataset(_write(tmp_path / "b", [50]), (0, 1), 4, 0)
    blend = BlendedDataset([a, b], [1.0, 3.0])
    blend.prepare(40)
    which, nth = blend_indices([1.0, 3.0], 40)
    for i in range(40):
        np.testing.assert_array_equal(blend[i], [a, b][which[i]][nth[i]])
    with pytest.raises(DataError, match="data.weights has 1 entries but data.prefixes has 2"):
        BlendedDataset([a, b], [1.0])
