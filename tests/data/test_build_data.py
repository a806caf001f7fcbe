"""build_data (contract E): exact resumption across DP degrees, eval determinism, entropy, errors, caches."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import sys
import sysconfig
import time
from collections import Counter

import numpy as np
import pytest
import torch

from llmtrain.config import JobConfig
from llmtrain.data import DataError, IndexedDataset, IndexedDatasetWriter, build_data, load_tokenizer
from llmtrain.data import corpus as corpus_mod
from llmtrain.data.preprocess import preprocess_documents


def _job(tmp_path, prefixes, tokenizer, **kw):
    job = JobConfig()
    job.model.vocab_size = kw.pop("vocab_size", 512)
    job.model.seq_length = kw.pop("seq_length", 32)
    job.train.global_batch_size = kw.pop("global_batch_size", 8)
    job.train.steps = kw.pop("steps", 10)
    job.data.prefixes = list(prefixes)
    job.data.tokenizer = tokenizer
    job.data.cache_dir = str(tmp_path / "cache")
    job.data.split = "80,20,0"  # the test corpus has few documents: 2% would be none
    for k, v in kw.items():
        setattr(job.data, k, v)
    return job


def _global_batches(job, dp, consumed, steps):
    """The global batches seen by a DP group of `dp` ranks: rank slices concatenated in rank order."""
    iters = [build_data(job, r, dp).train_batches(consumed) for r in range(dp)]
    return [torch.cat([next(it) for it in iters]) for _ in range(steps)]


def test_resuming_with_another_dp_degree_continues_exactly(tmp_path, dataset_prefix, sp_model):
    job = _job(tmp_path, [dataset_prefix], sp_model, steps=8)
    reference = _global_batches(job, 1, 0, 8)  # one rank reads every global batch whole
    gbs = job.train.global_batch_size
    run = (
        _global_batches(job, 4, 0, 3)
        + _global_batches(job, 2, 3 * gbs, 3)
        + _global_batches(job, 8, 6 * gbs, 2)
    )
    for step, (got, want) in enumerate(zip(run, reference, strict=True)):
        assert got.shape == (gbs, 33) and got.dtype == torch.int64
        assert torch.equal(got, want), f"global batch {step} differs after resharding"
    rows = torch.cat(reference)
    assert len({tuple(r.tolist()) for r in rows}) == len(rows)  # no sample repeated within the epoch


def test_uneven_shares_read_the_even_split_s_samples(tmp_path, dataset_prefix, sp_model):
    """train.dp_micro_batches [3, 1]: replica slices of 6 and 2 samples whose union, in rank order, is the
    global batch one rank (or two equal replicas) reads; eval batches likewise."""
    job = _job(tmp_path, [dataset_prefix], sp_model, steps=4)
    job.train.micro_batch_size = 2
    reference = _global_batches(job, 1, 0, 4)
    job.train.dp_micro_batches = [3, 1]
    assert [len(x) for x in (next(build_data(job, r, 2).train_batches()) for r in range(2))] == [6, 2]
    got = _global_batches(job, 2, 0, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    evals = [list(build_data(job, r, 2).eval_batches(2)) for r in range(2)]
    job.train.dp_micro_batches = []
    whole = list(build_data(job, 0, 1).eval_batches(2))
    assert all(torch.equal(torch.cat([evals[0][b], evals[1][b]]), whole[b]) for b in range(2))


def test_dataloader_workers_give_the_same_batches(tmp_path, dataset_prefix, sp_model):
    job = _job(tmp_path, [dataset_prefix], sp_model)
    plain = build_data(job, 1, 2).train_batches(16)
    job.data.num_workers = 2
    loader = build_data(job, 1, 2).train_batches(16)
    for _ in range(4):
        assert torch.equal(next(plain), next(loader))
    loader.close()


def test_eval_batches_are_deterministic_and_held_out(tmp_path, dataset_prefix, sp_model, docs):
    job = _job(tmp_path, [dataset_prefix], sp_model, split="80,20,0")
    dm = build_data(job, 1, 2)
    first, second = list(dm.eval_batches(3)), list(dm.eval_batches(3))
    assert len(first) == 3 and all(b.shape == (4, 33) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # Every eval token window comes from the valid documents (the last 20% of the dataset).
    ds = IndexedDataset(dataset_prefix)
    n_train = round(0.8 * len(ds))
    valid_text = "".join(dm.tokenizer.decode(ds[i].tolist()) for i in range(n_train, len(ds)))
    for row in first[0]:
        piece = dm.tokenizer.decode([t for t in row[1:-1].tolist() if t != dm.tokenizer.eod_id])
        assert piece[5:-5] in valid_text


def test_unigram_entropy_matches_counting(tmp_path, dataset_prefix, sp_model):
    dm = build_data(_job(tmp_path, [dataset_prefix], sp_model, split="90,10,0"))
    ds = IndexedDataset(dataset_prefix)
    counts = Counter(t for i in range(round(0.9 * len(ds))) for t in ds[i].tolist())
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert dm.unigram_entropy == pytest.approx(expected, rel=1e-9)
    assert dm.vocab_size == 512 and dm.tokenizer.eod_id == load_tokenizer(sp_model).eod_id


def test_blend_of_two_prefixes(tmp_path, dataset_prefix, sp_model, docs):
    other = str(tmp_path / "other")
    preprocess_documents(docs[::-1], other, sp_model)
    job = _job(tmp_path, [dataset_prefix, other], sp_model, weights=[1.0, 3.0], steps=4)
    batches = list(zip(range(4), build_data(job).train_batches(), strict=False))
    assert all(b.shape == (8, 33) for _, b in batches)
    job.data.weights = [1.0]
    with pytest.raises(
        DataError, match="data.weights has 1 entries but data.prefixes and data.sources have 2"
    ):
        build_data(job)


def test_vocabulary_errors(tmp_path, dataset_prefix, sp_model):
    with pytest.raises(DataError, match=r"model.vocab_size=300 is smaller .*512.*model.vocab_size >= 512"):
        build_data(_job(tmp_path, [dataset_prefix], sp_model, vocab_size=300))
    with pytest.raises(DataError, match="data.prefixes needs data.tokenizer"):
        build_data(_job(tmp_path, [dataset_prefix], None))
    narrow = str(tmp_path / "narrow")
    with IndexedDatasetWriter(narrow, np.uint8) as w:
        w.add_document(np.arange(200))
    with pytest.raises(DataError, match=r"narrow\.bin stores tokens as uint8 .* tokenizer has 512"):
        build_data(_job(tmp_path, [narrow], sp_model))
    foreign = str(tmp_path / "foreign")
    with IndexedDatasetWriter(foreign, np.uint16) as w:
        w.add_document(np.arange(900))
    with pytest.raises(DataError, match=r"foreign\.bin contains token id 899 but the tokenizer has 512"):
        build_data(_job(tmp_path, [foreign], sp_model, vocab_size=1024))
    with pytest.raises(DataError, match="not divisible by the data-parallel size 3"):
        build_data(_job(tmp_path, [dataset_prefix], sp_model), 0, 3)


def test_default_corpus_with_a_hugging_face_tokenizer(tmp_path, hf_dir, monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_CORPUS_BYTES", 100_000)
    job = _job(tmp_path, [], str(hf_dir), vocab_size=300)
    with pytest.raises(DataError, match=r"model.vocab_size=300 is smaller .*400 tokens"):
        build_data(job)
    assert not (tmp_path / "cache" / "corpus").exists()  # failed before preparing anything
    job.model.vocab_size = 400
    dm = build_data(job)
    assert dm.vocab_size == 400 and dm.tokenizer.eod_id == dm.tokenizer.encode("<|endoftext|>")[0]
    row = next(dm.train_batches())[0].tolist()
    corpus = IndexedDataset(next((tmp_path / "cache" / "corpus").glob("*/corpus.idx")).with_suffix(""))
    text = "".join(dm.tokenizer.decode(corpus[i].tolist()) for i in range(len(corpus)))
    cuts = [-1] + [i for i, t in enumerate(row) if t == dm.tokenizer.eod_id] + [len(row)]
    for lo, hi in zip(cuts, cuts[1:], strict=False):  # the window crosses documents at end-of-document tokens
        assert dm.tokenizer.decode(row[lo + 1 : hi]) in text


def test_missing_dataset_files_are_named_with_the_fix(tmp_path, dataset_prefix, sp_model):
    def error(prefixes):
        with pytest.raises(DataError) as e:
            build_data(_job(tmp_path, prefixes, sp_model))
        return str(e.value)

    missing = str(tmp_path / "data" / "corpus_text_document")
    assert error([dataset_prefix, missing]) == (
        f"data.prefixes entry {missing!r}: {missing}.idx does not exist; check the path or build the dataset "
        f"with tools/preprocess_data.py --output-prefix {tmp_path / 'data' / 'corpus'} --json-keys text "
        "(it writes PREFIX_KEY_document.bin/.idx)"
    )
    assert not (tmp_path / "cache" / "index").exists()  # found before any index was built for the first
    assert error([dataset_prefix + ".bin"]).endswith(
        f"{dataset_prefix}.bin is a file; a dataset prefix names it without .bin/.idx: use {dataset_prefix}"
    )
    near = tmp_path / "near"
    preprocess_documents(["some text"], str(near) + "_text_document", sp_model)
    assert f"did you mean {near}_text_document?" in error([str(near)])
    half = tmp_path / "half"
    (tmp_path / "half.bin").write_bytes(b"\0" * 8)
    assert f"{half}.idx does not exist beside {half}.bin: the preprocessing was interrupted" in error(
        [str(half)]
    )
    with pytest.raises(DataError, match=r"^tokenizer .*nothing\.model does not exist; set data.tokenizer"):
        build_data(_job(tmp_path, [dataset_prefix], str(tmp_path / "nothing.model")))


def test_first_use_of_the_corpus_reports_each_step(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_CORPUS_BYTES", 100_000)
    monkeypatch.delenv("RANK", raising=False)
    lines = []
    corpus = corpus_mod.prepare_corpus("stdlib", tmp_path, 512, log=lines.append, interval=0.0)
    root = tmp_path / "corpus"
    assert lines[0] == (
        f"[data] first use of the stdlib corpus: training a tokenizer on it and tokenizing it in {root} "
        "(cached for later runs)"
    )

    def index(pattern):
        return next(i for i, line in enumerate(lines) if re.match(pattern, line))

    steps = [
        index(r"\[data\] reading [\d,]+ files of .*: .* \(\d+%\), 1 files"),
        index(rf"\[data\] read {corpus.meta['documents']} documents \(.*\); SentencePiece now trains a 512-"),
        index(r"\[data\] tokenizer trained in [\d.]+ s$"),
        index(r"\[data\] tokenizing the stdlib corpus: .* \(\d+%\), \d+ documents, [\d,]+ tokens, .* ETA"),
        index(r"\[data\] tokenizing the stdlib corpus done in"),
        len(lines) - 1,
    ]
    assert steps == sorted(steps)  # each step reported, in order
    assert "(100%)" in lines[steps[4] - 1]  # the last progress line before the summary saw every document
    assert (
        lines[-1].startswith(f"[data] the stdlib corpus ready: {corpus.meta['documents']:,} documents, ")
        and f"{corpus.meta['tokens']:,} tokens, prepared in" in lines[-1]
    )
    lines.clear()
    assert corpus_mod.prepare_corpus("stdlib", tmp_path, 512, log=lines.append) == corpus
    assert lines == []  # cached: nothing to report


def test_empty_valid_split_with_eval_enabled(tmp_path, dataset_prefix, sp_model):
    with pytest.raises(DataError, match="valid split without tokens.*train.eval_interval"):
        build_data(_job(tmp_path, [dataset_prefix], sp_model, split="100,0,0"))


def _build_small_corpus(cache_dir, rank=0):
    corpus_mod.MAX_CORPUS_BYTES = 200_000  # forked children inherit this; the cache key includes it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    sys.stdout = open(f"{cache_dir}.rank{rank}.log", "w")  # noqa: SIM115 - this process's whole output
    job = JobConfig()
    job.model.vocab_size, job.model.seq_length = 1024, 64
    job.train.steps = 5
    job.data.cache_dir, job.data.split = cache_dir, "80,20,0"
    dm = build_data(job)
    return dm.unigram_entropy, next(dm.train_batches()).sum().item()


@pytest.mark.slow
def test_default_corpus_built_once_by_concurrent_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_CORPUS_BYTES", 200_000)
    with mp.get_context("fork").Pool(3) as pool:
        results = pool.starmap(_build_small_corpus, [(str(tmp_path / "cache"), rank) for rank in range(3)])
    assert len(set(results)) == 1
    # One builder (any rank) reports the work; of the others only rank 0 (local rank 0) may say it waits.
    logs = {rank: (tmp_path / f"cache.rank{rank}.log").read_text().splitlines() for rank in range(3)}
    builders = [
        rank for rank, lines in logs.items() if any("first use of the stdlib corpus" in x for x in lines)
    ]
    assert len(builders) == 1
    builder = builders[0]
    label = "[data]" if builder == 0 else f"[data rank {builder}]"
    assert all(line.startswith(label) for line in logs[builder])
    assert any(line.startswith(f"{label} the stdlib corpus ready: ") for line in logs[builder])
    for rank in set(range(3)) - {builder}:
        if rank == 0:  # a line per cache it waited on for over a second: the corpus, maybe an index
            corpus_wait = (
                rf"\[data\] waiting for pid \d+ on .*, rank {builder} to finish preparing the stdlib c.*"
            )
            assert sum(bool(re.fullmatch(corpus_wait, x)) for x in logs[0]) <= 1, logs[0]
            assert all(
                re.fullmatch(r"\[data\] waiting for pid \d+ on .*, rank \d to finish preparing .*", x)
                for x in logs[0]
            )
            assert len(set(logs[0])) == len(logs[0]), logs[0]
        else:
            assert logs[rank] == []
    folders = [p for p in (tmp_path / "cache" / "corpus").iterdir() if p.is_dir()]
    assert len(folders) == 1 and not list((tmp_path / "cache" / "corpus").glob("*.tmp-*"))
    # The corpus is the stdlib's real source text: decoding a document gives back a source file.
    ds = IndexedDataset(folders[0] / "corpus")
    tok = load_tokenizer(folders[0] / "tokenizer.model")
    text = tok.decode(ds[0][:-1].tolist())
    first_file = corpus_mod.stdlib_files()[0][1]
    assert text == first_file.read_text(encoding="utf-8", errors="replace")
    assert str(first_file).startswith(sysconfig.get_paths()["stdlib"])


@pytest.mark.slow
def test_real_default_corpus(tmp_path):
    """The default job's data as tools/pretrain.py gets it, prepared from scratch (timed)."""
    job = JobConfig()
    job.data.cache_dir = str(tmp_path / "cache")
    start = time.perf_counter()
    dm = build_data(job)
    seconds = time.perf_counter() - start
    meta = json.loads(next((tmp_path / "cache" / "corpus").glob("*/meta.json")).read_text())
    print(f"default corpus: {meta} first build {seconds:.1f}s, unigram entropy {dm.unigram_entropy:.3f}")
    assert dm.vocab_size == job.model.vocab_size == 8192
    assert meta["tokens"] > 2 * job.train.steps * job.train.global_batch_size * job.model.seq_length
    assert 4.0 < dm.unigram_entropy < math.log(8192)
    batch = next(dm.train_batches())
    assert batch.shape == (job.train.global_batch_size, job.model.seq_length + 1)
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    build_data(job)
    # The second start reuses every cache: it writes, rewrites and removes nothing.
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()} == written
