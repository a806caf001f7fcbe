"""data.sources: raw documents tokenized while training, in every format, resumable on any layout.

Reference: the documents read here with json/gzip and tokenized one by one with the SentencePiece model
(its own encode), each followed by the end-of-document token, concatenated epoch after epoch; sample i must
be that stream's tokens [i*L, i*L + L + 1), whatever the format, the number of ranks or of workers.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtrain.config import JobConfig
from llmtrain.data import DataError, build_data, load_tokenizer
from llmtrain.data.preprocess import preprocess_documents
from llmtrain.data.raw import SPLIT_CYCLE, RawStream, parse_source, split_slots

SEQ, GBS = 32, 8


@pytest.fixture(scope="module")
def records(docs) -> list[str]:
    """300 one-line documents (lines of stdlib modules, so .txt holds them as they are)."""
    lines = [line.strip() for doc in docs[:6] for line in doc.splitlines() if len(line.strip()) > 20]
    return lines[:300]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, records) -> Path:
    path = tmp_path_factory.mktemp("raw") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": r, "id": n}) + "\n" for n, r in enumerate(records)))
    return path


def reference_stream(records: list[str], sp_model: str, split: str, epochs: int = 2) -> np.ndarray:
    """The train split's tokens, document by document with the end-of-document token, `epochs` times."""
    tok = load_tokenizer(sp_model)
    train = set(split_slots(split)[0])
    epoch = [
        t for n, r in enumerate(records) if n % SPLIT_CYCLE in train for t in [*tok.encode(r), tok.eod_id]
    ]
    return np.array(epoch * epochs, dtype=np.int64)


def _job(tmp_path, sources, sp_model, **data) -> JobConfig:
    job = JobConfig()
    job.model.vocab_size, job.model.seq_length = 512, SEQ
    job.train.global_batch_size, job.train.steps, job.train.eval_interval = GBS, 40, 0
    job.data.sources, job.data.tokenizer = [str(s) for s in sources], sp_model
    job.data.cache_dir, job.data.split = str(tmp_path / "cache"), "90,10,0"
    for key, value in data.items():
        setattr(job.data, key, value)
    return job


def _expected_rows(stream: np.ndarray, first: int, count: int) -> np.ndarray:
    return np.stack([stream[i * SEQ : i * SEQ + SEQ + 1] for i in range(first, first + count)])


def _check_formats(entries: list, records: list[str], sp_model: str) -> None:
    want = _expected_rows(reference_stream(records, sp_model, "90,10,0"), 0, 24)
    for entry in entries:
        stream = RawStream(
            parse_source(str(entry)), "train", split_slots("90,10,0")[0], SEQ, sp_model, "text"
        )
        got = np.stack([stream[i] for i in range(24)])
        assert np.array_equal(got, want), entry


def test_file_formats_give_the_reference_samples(tmp_path, records, jsonl, sp_model):
    """JSONL, gzipped JSONL, Parquet and plain text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.write(jsonl.read_text())
    (tmp_path / "docs.txt").write_text("".join(r + "\n" for r in records))
    pq.write_table(pa.table({"text": records}), tmp_path / "docs.parquet")
    formats = ["docs.jsonl.gz", "docs.parquet", "docs.txt"]
    _check_formats([jsonl, *(tmp_path / f for f in formats)], records, sp_model)


@pytest.mark.slow
def test_datasets_sources_give_the_reference_samples(tmp_path, records, jsonl, sp_model):
    """A save_to_disk folder and an hf: data-files spec (datasets.load_dataset, streaming)."""
    import datasets

    datasets.Dataset.from_dict({"text": records}).save_to_disk(tmp_path / "saved")
    _check_formats([tmp_path / "saved", f"hf:json?data_files={jsonl}"], records, sp_model)


def _run(job, layout: list[tuple[int, int, int]], position: dict | None = None):
    """Train batches of `layout`'s segments (ranks, workers, steps), each resumed from the position the
    last saved; returns the global batches (rank slices in rank order) and each row's sample number."""
    batches, ids, consumed = [], [], 0
    for ranks, workers, steps in layout:
        job.data.num_workers = workers
        modules = [build_data(job, r, ranks) for r in range(ranks)]
        iters = [m.train_batches(consumed, position) for m in modules]
        per_rank = GBS // ranks
        for _ in range(steps):
            batches.append(torch.cat([next(it) for it in iters]))
            ids += [consumed + r * per_rank + j for r in range(ranks) for j in range(per_rank)]
            consumed += GBS
        positions = [m.position(consumed) for m in modules]
        assert all(p == positions[0] for p in positions), "every rank must save the same position"
        position = positions[0]
        for m in modules:
            m.workers.close()
    return batches, ids, position


@pytest.mark.slow  # 2 s: with the whole suite, not the quick subset
def test_resume_on_other_layouts_gives_every_sample_once(tmp_path, records, jsonl, sp_model):
    """4 ranks -> 2 ranks -> 4 ranks (a position saved and given at each change), over more than one
    epoch: the same global batches as one uninterrupted rank, bit for bit; each sample number consumed
    exactly once; sample i is the reference stream's window i, so every document of an epoch is read
    once, in order, and the next epoch follows."""
    job = _job(tmp_path, [jsonl], sp_model)
    stream = reference_stream(records, sp_model, job.data.split)
    epoch_samples = len(stream) // 2 // SEQ
    steps = epoch_samples // GBS + 3  # into the second epoch
    reference, _, _ = _run(job, [(1, 0, steps)])
    got, ids, position = _run(job, [(4, 0, 4), (2, 0, 4), (4, 0, steps - 8)])
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    assert sorted(ids) == list(range(steps * GBS))  # none skipped, none repeated
    rows = torch.cat(got).numpy()
    assert np.array_equal(rows, _expected_rows(stream, 0, steps * GBS))
    assert steps * GBS > epoch_samples and position["raw"][0]["epoch"] == 1
    # Without the position the streams re-read the data up to consumed_samples: the same batches.
    again, _, _ = _run(job, [(2, 0, 4)], position=None)
    assert all(torch.equal(a, b) for a, b in zip(again, reference, strict=False))


@pytest.mark.slow
def test_tokenizing_workers_do_not_change_the_stream(tmp_path, records, jsonl, sp_model):
    """2 ranks with 2 workers each -> 4 ranks with 1 -> 1 rank inline: the uninterrupted batches."""
    job = _job(tmp_path, [jsonl], sp_model)
    reference, _, _ = _run(job, [(1, 0, 9)])
    got, _, _ = _run(job, [(2, 2, 3), (4, 1, 3), (1, 0, 3)])
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def _tokens(stream: RawStream, first: int, count: int) -> np.ndarray:
    """Tokens [first*SEQ, (first+count)*SEQ) of the stream, read as samples first.. (each shares its last
    token with the next)."""
    return np.concatenate([stream[i][:-1] for i in range(first, first + count)])


def test_shuffled_documents_follow_the_seed_and_resume_exactly(records, jsonl, sp_model):
    """data.shuffle_documents: each epoch holds the same documents in another order, drawn from the seed
    alone; a stream resumed from a mid-epoch position continues it token for token into the next epoch."""
    slots, eod = split_slots("90,10,0")[0], load_tokenizer(sp_model).eod_id

    def stream(seed: int | None) -> RawStream:
        return RawStream(parse_source(str(jsonl)), "train", slots, SEQ, sp_model, "text", seed=seed)

    epoch = len(reference_stream(records, sp_model, "90,10,0", epochs=1))
    count = 2 * epoch // SEQ + 1  # two whole epochs
    plain, first, again, other = (_tokens(stream(s), 0, count) for s in (None, 7, 7, 8))

    def documents(tokens: np.ndarray) -> list[tuple[int, ...]]:
        return [tuple(d) for d in np.split(tokens, np.flatnonzero(tokens == eod) + 1)[:-1]]

    assert np.array_equal(first, again) and not np.array_equal(first, other)
    for e in (0, 1):
        one = slice(e * epoch, (e + 1) * epoch)
        assert sorted(documents(first[one])) == sorted(documents(plain[one]))  # every document once
        assert documents(first[one]) != documents(plain[one])
    assert documents(first[:epoch]) != documents(first[epoch : 2 * epoch])  # each epoch its own order
    middle = count // 3
    state = stream(7).state(middle)
    resumed = stream(7)
    assert resumed.seek(state) and not stream(8).seek(state)  # another seed is other data
    assert np.array_equal(_tokens(resumed, middle, count - middle), first[middle * SEQ :])


def test_raw_source_and_prefix_blend_by_weight(tmp_path, records, jsonl, sp_model, docs):
    prefix = str(tmp_path / "docs")
    preprocess_documents(docs, prefix, sp_model)
    job = _job(tmp_path, [jsonl], sp_model, prefixes=[prefix], weights=[1.0, 3.0])
    reference, _, _ = _run(job, [(1, 0, 6)])
    got, _, position = _run(job, [(2, 0, 3), (4, 0, 3)])
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    # 3 of every 4 samples are the raw source's, in its own order.
    raw = _expected_rows(reference_stream(records, sp_model, job.data.split), 0, 36)
    rows = torch.cat(reference).numpy()
    from_raw = [row for row in rows if any(np.array_equal(row, r) for r in raw)]
    assert np.array_equal(np.stack(from_raw), raw)
    assert position["raw"][0]["sample"] == 36
    job.data.weights = []
    with pytest.raises(DataError, match=r"data.sources with 1 other entry needs data.weights"):
        build_data(job)


def test_valid_split_is_held_out_records(tmp_path, records, jsonl, sp_model):
    job = _job(tmp_path, [jsonl], sp_model)
    job.train.eval_interval = 10
    dm = build_data(job, 0, 1)
    tok = dm.tokenizer
    valid = set(split_slots(job.data.split)[1])
    want = [
        t for n, r in enumerate(records) if n % SPLIT_CYCLE in valid for t in [*tok.encode(r), tok.eod_id]
    ]
    first, second = list(dm.eval_batches(2)), list(dm.eval_batches(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert np.array_equal(torch.cat(first).numpy(), _expected_rows(np.array(want), 0, 2 * GBS))


def _write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


BAD = [
    (b'{"text": "half', "invalid JSON"),
    (b'{"body": "no text key"}', "record has no key 'text'"),
    (b'{"text": "caf\xe9"}', "not UTF-8"),
    (b'{"text": ""}', "empty document"),
]


def test_bad_records_are_skipped_counted_and_named(tmp_path, records, sp_model, capsys):
    good = [json.dumps({"text": r}).encode() for r in records[:200]]
    lines = good[:3] + [b for b, _ in BAD] + good[3:]
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    job = _job(tmp_path, [path], sp_model, split="100,0,0")
    dm = build_data(job)
    rows = torch.cat([b for _, b in zip(range(6), dm.train_batches(), strict=False)]).numpy()
    assert np.array_equal(rows, _expected_rows(reference_stream(records[:200], sp_model, "100,0,0"), 0, 48))
    out = capsys.readouterr().out
    for n, (_, why) in enumerate(BAD):
        assert f"skipping {path}:{4 + n}: {why}" in out
    job.data.on_bad_document = "error"
    with pytest.raises(DataError, match=r"bad\.jsonl:4: invalid JSON .*data.on_bad_document=skip"):
        build_data(job)


def test_a_source_without_readable_text_stops_naming_it_and_the_key(tmp_path, records, sp_model):
    path = _write_lines(tmp_path / "body.jsonl", [json.dumps({"body": r}).encode() for r in records[:150]])
    job = _job(tmp_path, [path], sp_model, split="100,0,0")
    with pytest.raises(
        DataError,
        match=r"none of the first 150 records of .*body\.jsonl is readable .*"
        r"record has no key 'text'.*data.text_key",
    ):
        build_data(job)
    empty = _write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(
        DataError,
        match=r"'.*empty\.jsonl' gives no readable train document \(1 empty input\)"
        r".*data.text_key='text'",
    ):
        build_data(_job(tmp_path, [empty], sp_model))


def test_an_empty_input_among_others_is_skipped_and_named(tmp_path, records, sp_model, capsys):
    folder = tmp_path / "parts"
    folder.mkdir()
    _write_lines(folder / "a.jsonl", [])
    _write_lines(folder / "b.jsonl", [json.dumps({"text": r}).encode() for r in records[:200]])
    job = _job(tmp_path, [folder / "*.jsonl"], sp_model, split="100,0,0")
    dm = build_data(job)
    rows = next(dm.train_batches()).numpy()
    assert np.array_equal(rows, _expected_rows(reference_stream(records[:200], sp_model, "100,0,0"), 0, GBS))
    list(zip(range(40), dm.train_batches(), strict=False))  # past the first epoch: its summary
    out = capsys.readouterr().out
    assert f"skipping {folder / 'a.jsonl'}: no records" in out and "1 empty input skipped" in out


def test_entry_errors_are_one_line(tmp_path, sp_model):
    with pytest.raises(DataError, match=r"data.sources entry 'missing.jsonl': missing.jsonl does not exist"):
        parse_source("missing.jsonl")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(DataError, match=r"x\.csv'?: .*unknown format; use \.jsonl"):
        parse_source(str(tmp_path / "x.csv"))
    with pytest.raises(DataError, match=r"write hf:NAME.*not \['shuffle'\]"):
        parse_source("hf:someone/tiny?shuffle=1")
    with pytest.raises(DataError, match="data.sources needs data.tokenizer"):
        build_data(_job(tmp_path, [tmp_path / "x.csv"], None))


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    """A Hugging Face cache in tmp (what load_dataset('someone/tiny') leaves there), used offline."""
    import datasets

    cache = tmp_path / "hf" / "datasets"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hub_dataset_streams_offline(tmp_path, records, jsonl, sp_model, hf_offline):
    from datasets.packaged_modules.json.json import Json

    # The layout load_dataset gives a hub dataset's cache: <cache>/<owner>___<name>/<config>/<version>/<hash>.
    builder = Json(cache_dir=str(hf_offline), dataset_name="someone___tiny", data_files={"train": str(jsonl)},
                   hash="0123abcd")  # fmt: skip
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    final = hf_offline / "someone___tiny" / "default" / "0.0.0" / "0123abcd"
    final.parent.mkdir(parents=True)
    built.rename(final)
    (final / "someone___tiny-train.arrow").rename(final / "tiny-train.arrow")
    stream = RawStream(
        parse_source("hf:someone/tiny"), "train", split_slots("90,10,0")[0], SEQ, sp_model, "text"
    )
    want = _expected_rows(reference_stream(records, sp_model, "90,10,0"), 0, 8)
    assert np.array_equal(np.stack([stream[i] for i in range(8)]), want)
    missing = RawStream(parse_source("hf:someone/other"), "train", (0,), SEQ, sp_model, "text")
    with pytest.raises(
        DataError,
        match=r"'someone/other' is not in the local Hugging Face cache .*make it "
        r"available offline .*load_dataset\('someone/other'",
    ):
        missing[0]
