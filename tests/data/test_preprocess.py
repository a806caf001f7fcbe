"""Preprocessing: every input format gives the reference tokenization, in order, with any worker count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from llmtrain.data import DataError, IndexedDataset
from llmtrain.data.preprocess import preprocess_files

ROOT = Path(__file__).resolve().parents[2]


def _expected(sp_model, texts, eod=True):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    return [sp.encode(t) + ([sp.eos_id()] if eod else []) for t in texts]


def _read_all(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def records(docs):
    return [{"text": d, "title": d.split("\n", 1)[0] or "x", "n": i} for i, d in enumerate(docs[:40])]


@pytest.fixture
def jsonl(tmp_path, records):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_two_keys_any_worker_count(tmp_path, jsonl, records, sp_model, workers, monkeypatch):
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 3)  # many chunks: order must survive the pool
    out = preprocess_files(
        [jsonl], str(tmp_path / "out"), sp_model, ["text", "title"], workers=workers, log=None
    )
    assert list(out) == [str(tmp_path / "out_text_document"), str(tmp_path / "out_title_document")]
    assert _read_all(tmp_path / "out_text_document") == _expected(sp_model, [r["text"] for r in records])
    assert _read_all(tmp_path / "out_title_document") == _expected(sp_model, [r["title"] for r in records])
    assert IndexedDataset(tmp_path / "out_text_document").dtype == np.uint16  # vocab 512 > 256


def test_text_parquet_and_datasets_inputs(tmp_path, records, sp_model):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [r["title"] for r in records]  # one line each
    (tmp_path / "in.txt").write_text("\n\n".join(texts) + "\n")  # blank lines separate, are not documents
    pq.write_table(pa.table({"text": [r["text"] for r in records]}), tmp_path / "in.parquet")
    datasets.Dataset.from_dict({"body": [r["text"] for r in records]}).save_to_disk(str(tmp_path / "hf"))
    preprocess_files([str(tmp_path / "in.txt")], str(tmp_path / "t"), sp_model, log=None, workers=1)
    preprocess_files([str(tmp_path / "in.parquet")], str(tmp_path / "p"), sp_model, log=None, workers=1)
    preprocess_files([str(tmp_path / "hf")], str(tmp_path / "h"), sp_model, ["body"], log=None, workers=1)
    assert _read_all(tmp_path / "t_text_document") == _expected(sp_model, texts)
    full = _expected(sp_model, [r["text"] for r in records])
    assert _read_all(tmp_path / "p_text_document") == full
    assert _read_all(tmp_path / "h_body_document") == full


def test_without_eod_and_progress(tmp_path, jsonl, records, sp_model):
    lines = []
    preprocess_files([jsonl], str(tmp_path / "o"), sp_model, append_eod=False, workers=1, log=lines.append)
    assert _read_all(tmp_path / "o_text_document") == _expected(
        sp_model, [r["text"] for r in records], eod=False
    )
    assert f"{len(records)} docs" in lines[-1] and "tokens/s" in lines[-1]


def test_empty_documents(tmp_path, sp_model):
    path = tmp_path / "e.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": ""}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"e\.jsonl:3: empty document.*--skip-empty"):
        preprocess_files([str(path)], str(tmp_path / "e"), sp_model, log=None, workers=1)
    assert not list(tmp_path.glob("e_*"))  # nothing half-written
    stats = preprocess_files([str(path)], str(tmp_path / "e"), sp_model, log=None, workers=2, skip_empty=True)
    assert next(iter(stats.values())).skipped_empty == 1
    assert _read_all(tmp_path / "e_text_document") == _expected(sp_model, ["a", "b"])


def test_bad_records(tmp_path, sp_model):
    path = tmp_path / "b.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: record has no key 'text'.*--json-keys"):
        preprocess_files([str(path)], str(tmp_path / "b"), sp_model, log=None, workers=2)
    path.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: invalid JSON"):
        preprocess_files([str(path)], str(tmp_path / "b"), sp_model, log=None, workers=1)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format"):
        preprocess_files([str(tmp_path / "x.csv")], str(tmp_path / "b"), sp_model, log=None)


@pytest.mark.slow
def test_tools_end_to_end(tmp_path, jsonl, records, sp_model, mcore_indexed):
    """The two command-line tools, as a user runs them; megatron-core reads the result."""
    run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True)
    run(
        str(ROOT / "tools/train_tokenizer.py"),
        "--input",
        jsonl,
        "--model-prefix",
        str(tmp_path / "tok"),
        "--vocab-size",
        "700",
    )
    out = run(
        str(ROOT / "tools/preprocess_data.py"),
        "--input",
        jsonl,
        "--output-prefix",
        str(tmp_path / "d"),
        "--tokenizer-model",
        str(tmp_path / "tok.model"),
        "--append-eod",
        "--workers",
        "2",
    )
    assert f"{len(records)} docs" in out.stdout
    ref = mcore_indexed.IndexedDataset(str(tmp_path / "d_text_document"))
    expected = _expected(str(tmp_path / "tok.model"), [r["text"] for r in records])
    assert [ref[i].tolist() for i in range(len(ref))] == expected
    bad = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/preprocess_data.py"),
            "--input",
            "nope.jsonl",
            "--output-prefix",
            "x",
            "--tokenizer-model",
            str(tmp_path / "tok.model"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "nope.jsonl does not exist" in bad.stderr


def test_reading_stays_bounded_ahead_of_writing(sp_model, monkeypatch):
    """Streaming: the reader runs at most a fixed number of chunks ahead, whatever the input size."""
    from llmtrain.data.preprocess import _ordered_results, _text_chunks

    monkeypatch.setattr("llmtrain.data.preprocess.CHUNK_RECORDS", 10)
    pulled = 0

    def counting():
        nonlocal pulled
        for i in range(1000):
            pulled += 1
            yield f"document number {i}"

    chunks = _text_chunks(counting(), "gen")
    results = _ordered_results(chunks, 2, (sp_model, ["text"], True, False))
    next(results)
    assert pulled <= 10 * (2 * 2 + 2 + 1)  # the look-ahead bound; a greedy feeder would read all 1000
    results.close()
