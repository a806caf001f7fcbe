"""Preprocessing: every input format gives the reference tokenization, in order, with any worker count;
nothing is thrown away for an empty or unreadable record, and the output is all or nothing.

The reference is SentencePiece itself (`_expected`), megatron-core reads what the tools write, and sizes
on disk come from the file system.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from llmtrain.data import DataError, IndexedDataset
from llmtrain.data import preprocess as preprocess_mod
from llmtrain.data.preprocess import preprocess_files
from llmtrain.data.progress import size
from llmtrain.data.sources import NAMED_BAD, SYSTEMATIC_BAD

ROOT = Path(__file__).resolve().parents[2]


def _expected(sp_model, texts, eod=True):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    return [sp.encode(t) + ([sp.eos_id()] if eod else []) for t in texts]


def _read_all(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _files(folder):
    return sorted(p.name for p in Path(folder).iterdir())


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
    titles = out[str(tmp_path / "out_title_document")]
    assert titles.documents == len(records) and titles.tokens == sum(
        map(len, _read_all(tmp_path / "out_title_document"))
    )


@pytest.mark.slow  # 2 s: with the whole suite, not the quick subset
def test_text_parquet_datasets_and_gzip_inputs(tmp_path, records, sp_model):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [r["title"] for r in records]  # one line each
    # Blank lines separate documents and are not documents; Windows line ends are not part of the text.
    (tmp_path / "in.txt").write_bytes(("\n\n".join(texts) + "\n").replace("\n", "\r\n").encode())
    pq.write_table(pa.table({"text": [r["text"] for r in records]}), tmp_path / "in.parquet")
    datasets.Dataset.from_dict({"body": [r["text"] for r in records]}).save_to_disk(str(tmp_path / "hf"))
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    preprocess_files([str(tmp_path / "in.txt")], str(tmp_path / "t"), sp_model, log=None, workers=1)
    preprocess_files([str(tmp_path / "in.parquet")], str(tmp_path / "p"), sp_model, log=None, workers=1)
    preprocess_files([str(tmp_path / "hf")], str(tmp_path / "h"), sp_model, ["body"], log=None, workers=1)
    preprocess_files([str(tmp_path / "in.jsonl.gz")], str(tmp_path / "g"), sp_model, log=None, workers=2)
    assert _read_all(tmp_path / "t_text_document") == _expected(sp_model, texts)
    full = _expected(sp_model, [r["text"] for r in records])
    assert _read_all(tmp_path / "p_text_document") == full
    assert _read_all(tmp_path / "h_body_document") == full
    assert _read_all(tmp_path / "g_text_document") == full


def _percentages(lines):
    return [int(m[1]) for line in lines if (m := re.search(r"\((\d+)%\)", line))]


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz", "in.parquet"])
def test_progress_lines_count_the_input_on_disk(tmp_path, records, sp_model, monkeypatch, name):
    """Every chunk's share of its file adds up to the file's size as the file system reports it."""
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 4)
    path = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [r["text"] for r in records]}), path)
    else:
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    lines = []
    stats = preprocess_files(
        [str(path)],
        str(tmp_path / "o"),
        sp_model,
        append_eod=False,
        workers=2,
        log=lines.append,
        log_interval=0,
    )
    progress, summary = lines[:-1], lines[-1]
    assert len(progress) == -(-len(records) // 4)  # a line per chunk at interval 0: every chunk counted
    assert all(line.startswith("[preprocess] tokenizing: ") for line in progress)
    pct = _percentages(progress)
    assert pct == sorted(pct) and pct[-1] == 100 and pct[0] < 100
    assert re.search(r", [\d.]+[kM]?B/s, [\d.]+[kM]? tokens/s, ETA [\d.]+ s$", progress[0]), progress[0]
    assert f"of {size(os.path.getsize(path))} (100%)" in progress[-1]
    s = next(iter(stats.values()))
    assert s.tokens == sum(map(len, _read_all(tmp_path / "o_text_document")))
    assert f"{len(records)} documents, {s.tokens:,} tokens" in summary and summary.startswith(
        "[preprocess] tokenizing done in"
    )


def test_progress_is_printed_at_its_cadence_not_per_chunk(tmp_path, jsonl, records, sp_model, monkeypatch):
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 1)  # 40 chunks
    lines = []
    preprocess_files([jsonl], str(tmp_path / "o"), sp_model, workers=1, log=lines.append, log_interval=3600)
    assert len(lines) == 1 and "done in" in lines[0]  # the summary only: no chunk was an hour apart


def test_empty_documents_are_skipped_and_counted(tmp_path, sp_model):
    path = tmp_path / "e.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": ""}\n{"text": "b"}\n{"text": "", "title": "t"}\n')
    lines = []
    stats = preprocess_files([str(path)], str(tmp_path / "e"), sp_model, log=lines.append, workers=2)
    s = next(iter(stats.values()))
    assert (s.documents, s.skipped_empty, s.skipped_bad) == (2, 2, 0)
    assert _read_all(tmp_path / "e_text_document") == _expected(sp_model, ["a", "b"])
    assert lines[-1].endswith("; 2 empty documents skipped")
    path.write_text('{"text": ""}\n\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"no documents for .*e2_text_document.*2 empty documents skipped"):
        preprocess_files([str(path)], str(tmp_path / "e2"), sp_model, log=None, workers=1)
    assert not [n for n in _files(tmp_path) if n.startswith("e2")]  # nothing half-written


BAD_LINES = {
    2: (b'{"text": \n', r"invalid JSON \(Expecting value"),
    4: (b'{"body": "b"}\n', r"record has no key 'text' \(it has \['body'\]\)"),
    5: (b'{"text": 7}\n', r"'text' is int, not a string"),
    6: (b'{"text": "caf\xe9"}\n', r"not UTF-8 text \(byte 0xe9 at byte 14 of the line\)"),
    7: (b'["text"]\n', r"a JSON list, not an object"),
    8: (b'{"text": null}\n', r"'text' is null, not a string"),
}


def _mixed_input(path):
    good = {1: "first", 3: "second", 9: "third"}
    lines = [
        BAD_LINES[n][0] if n in BAD_LINES else json.dumps({"text": good[n]}).encode() + b"\n"
        for n in range(1, 10)
    ]
    path.write_bytes(b"".join(lines))
    return list(good.values())


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_records_are_skipped_counted_and_named(tmp_path, sp_model, workers, monkeypatch):
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 2)  # bad records in several chunks
    path = tmp_path / "m.jsonl"
    good = _mixed_input(path)
    lines = []
    stats = preprocess_files([str(path)], str(tmp_path / "m"), sp_model, workers=workers, log=lines.append)
    s = next(iter(stats.values()))
    assert (s.documents, s.skipped_bad) == (3, len(BAD_LINES))
    assert _read_all(tmp_path / "m_text_document") == _expected(sp_model, good)
    named = [line for line in lines if " skipping " in line]
    assert len(named) == NAMED_BAD  # the first few, in input order, then counted only
    for line, (n, (_, why)) in zip(named, sorted(BAD_LINES.items()), strict=False):
        assert re.search(rf"^\[preprocess\] skipping .*m\.jsonl:{n}: {why}", line), line
    assert "further unreadable records are counted, not named" in named[-1]
    assert re.search(r"6 unreadable records skipped \(first: .*m\.jsonl:2: invalid JSON", lines[-1])


@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_on_bad_document_error_stops_naming_the_record(tmp_path, sp_model, line):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' * 3 + BAD_LINES[line][0] + b'{"text": "fine"}\n')
    with pytest.raises(DataError, match=rf"x\.jsonl:4: {BAD_LINES[line][1]}.*--on-bad-document skip"):
        preprocess_files(
            [str(path)], str(tmp_path / "x"), sp_model, log=None, workers=2, on_bad_document="error"
        )
    assert _files(tmp_path) == ["x.jsonl"]  # no output, no temporary left behind


def test_an_input_without_one_readable_record_stops_early(tmp_path, sp_model, monkeypatch):
    """A wrong --json-keys is not a few damaged lines: the run stops at once instead of skipping it all."""
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 10)
    pulled = []
    real = preprocess_mod.read_chunks

    def counting(*args):
        for chunk in real(*args):
            pulled.append(len(chunk.items))
            yield chunk

    monkeypatch.setattr(preprocess_mod, "read_chunks", counting)
    path = tmp_path / "w.jsonl"
    path.write_text('{"body": "text"}\n' * 5000)
    with pytest.raises(
        DataError,
        match=rf"^none of the first {SYSTEMATIC_BAD} records of .*w\.jsonl is readable \(first: "
        r".*w\.jsonl:1: record has no key 'text'.*\); its format or --json-keys is wrong.*: "
        r"pass --json-keys naming the text",
    ):
        preprocess_files([str(path)], str(tmp_path / "w"), sp_model, log=None, workers=1)
    assert sum(pulled) == SYSTEMATIC_BAD  # stopped after 100 records, not 5000
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "a"}\n')
    path.write_text('{"body": "text"}\n' * 3)  # a second input entirely unreadable, however short
    with pytest.raises(
        DataError, match=r"^none of the 3 records of .*w\.jsonl is readable \(first: .*w\.jsonl:1: "
    ):
        preprocess_files([str(short), str(path)], str(tmp_path / "w"), sp_model, log=None, workers=1)
    assert _files(tmp_path) == ["short.jsonl", "w.jsonl"]


def test_inputs_tokenizer_and_outputs_are_checked_before_any_work(tmp_path, jsonl, sp_model, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("reading started before the arguments were checked")

    monkeypatch.setattr(preprocess_mod, "_write", no_work)
    out = str(tmp_path / "o")
    with pytest.raises(DataError, match=r"--input .*nope\.jsonl does not exist; check the path"):
        preprocess_files([jsonl, str(tmp_path / "nope.jsonl")], out, sp_model, log=None)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x\.csv: unknown format; use \.jsonl"):
        preprocess_files([jsonl, str(tmp_path / "x.csv")], out, sp_model, log=None)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder is a directory but not a dataset saved with datasets"):
        preprocess_files([str(tmp_path / "folder")], out, sp_model, log=None)
    with pytest.raises(
        DataError, match=r"--tokenizer-model .*tok\.model does not exist; pass a SentencePiece"
    ):
        preprocess_files([jsonl], out, str(tmp_path / "tok.model"), log=None)
    (tmp_path / "o_title_document.idx").write_bytes(b"someone's data")
    with pytest.raises(DataError, match=r"o_title_document\.idx already exists and is kept.*--overwrite"):
        preprocess_files([jsonl], out, sp_model, ["text", "title"], log=None)


def test_an_existing_dataset_is_kept_unless_overwrite(tmp_path, jsonl, records, sp_model):
    out = str(tmp_path / "o")
    preprocess_files([jsonl], out, sp_model, log=None, workers=1, append_eod=False)
    before = {n: (tmp_path / n).read_bytes() for n in ("o_text_document.bin", "o_text_document.idx")}
    with pytest.raises(DataError, match=r"o_text_document\.(bin|idx) already exists and is kept"):
        preprocess_files([jsonl], out, sp_model, log=None, workers=1)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    preprocess_files([jsonl], out, sp_model, log=None, workers=1, overwrite=True)
    assert _read_all(tmp_path / "o_text_document") == _expected(sp_model, [r["text"] for r in records])
    assert _files(tmp_path) == ["in.jsonl", "o_text_document.bin", "o_text_document.idx"]


def test_an_error_mid_run_leaves_nothing_and_keeps_the_old_output(
    tmp_path, jsonl, records, sp_model, monkeypatch
):
    monkeypatch.setattr("llmtrain.data.sources.CHUNK_RECORDS", 2)
    assert len(records) > 2 * 4  # the failure below comes mid-run, with chunks still to go
    out = str(tmp_path / "o")
    preprocess_files([jsonl], out, sp_model, ["text", "title"], log=None, workers=1)
    before = {n: (tmp_path / n).read_bytes() for n in _files(tmp_path) if n.startswith("o_")}
    real, calls = preprocess_mod._Encoder.__call__, []

    def failing(self, chunk):
        calls.append(chunk)
        if len(calls) == 4:
            raise RuntimeError("the disk is full")
        return real(self, chunk)

    monkeypatch.setattr(preprocess_mod._Encoder, "__call__", failing)
    with pytest.raises(RuntimeError, match="disk is full"):
        preprocess_files([jsonl], out, sp_model, ["text", "title"], log=None, workers=1, overwrite=True)
    assert {n: (tmp_path / n).read_bytes() for n in _files(tmp_path) if n.startswith("o_")} == before
    assert len(_files(tmp_path)) == 1 + len(before)  # no temporary left


def test_datasets_of_several_keys_appear_together_or_not_at_all(tmp_path, jsonl, sp_model, monkeypatch):
    from llmtrain.data.indexed import IndexedDatasetWriter

    real, sealed = IndexedDatasetWriter.seal, []

    def seal(self):
        sealed.append(self.prefix)
        if len(sealed) == 2:
            raise OSError("no space left on device")
        real(self)

    monkeypatch.setattr(IndexedDatasetWriter, "seal", seal)
    with pytest.raises(OSError, match="no space"):
        preprocess_files([jsonl], str(tmp_path / "o"), sp_model, ["text", "title"], log=None, workers=1)
    assert _files(tmp_path) == ["in.jsonl"]  # the first key's complete dataset was not published alone


def _big_input(path, docs, megabytes):
    line = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    path.write_text(line * max(1, int(megabytes * 1e6 / len(line))))


def _tool(*args, **kwargs):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tools/preprocess_data.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a terminal's Ctrl-C signals as a whole
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, group", [(signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGTERM, False)]
)
def test_interrupted_tool_leaves_nothing_and_keeps_the_old_output(tmp_path, docs, sp_model, sig, group):
    """Ctrl-C (SIGINT to the process group, workers included), SIGTERM to the group (a scheduler) or to
    the tool alone (kill): the partial files go, an existing dataset being replaced stays as it was, the
    workers stop with the tool (their open stdout would make communicate() time out), and the user reads
    one line, not tracebacks. Before the workers ignored signals, SIGTERM to the group hung the tool in
    one run of 5 to 20 (a worker killed while sending a result; multiprocessing.Pool and
    ProcessPoolExecutor alike)."""
    # 48 MB take seconds to tokenize even on an idle machine, so the signal sent after the first progress
    # line lands mid-run although a loaded machine may deschedule this test for a while (8 MB finished first
    # once, under the whole suite).
    _big_input(tmp_path / "big.jsonl", docs, 48)
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": docs[0]}) + "\n")
    common = ["--output-prefix", str(tmp_path / "o"), "--tokenizer-model", sp_model, "--workers", "2"]
    first = _tool("--input", str(tmp_path / "small.jsonl"), *common)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    before = {n: (tmp_path / n).read_bytes() for n in ("o_text_document.bin", "o_text_document.idx")}
    run = _tool("--input", str(tmp_path / "big.jsonl"), *common, "--overwrite", "--log-interval", "0.2")
    first_line = run.stdout.readline()  # tokenizing has started: the temporary .bin is being written
    assert "[preprocess] tokenizing:" in first_line and "(100%)" not in first_line
    if group:
        os.killpg(run.pid, sig)
    else:
        os.kill(run.pid, sig)
    out, err = run.communicate(timeout=120)
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert run.returncode == 128 + sig
    assert err == f"preprocess_data: stopped by {name}; nothing was written\n"
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert _files(tmp_path) == ["big.jsonl", "o_text_document.bin", "o_text_document.idx", "small.jsonl"]


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
    assert f"{len(records)} documents" in out.stdout
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
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == (
        "preprocess_data: error: --input nope.jsonl does not exist; "
        f"check the path (relative to {os.getcwd()})\n"
    )


@pytest.mark.parametrize("tool", ["preprocess_data.py", "train_tokenizer.py"])
def test_help_imports_no_library(tool):
    code = (
        "import runpy, sys, time\n"
        "start = time.perf_counter()\n"
        f"sys.argv = [{str(ROOT / 'tools' / tool)!r}, '--help']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'sentencepiece', 'tqdm')\n"
        "         or m.startswith('llmtrain.data')]\n"
        "print('imported:', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--debug" in done.stdout and "--overwrite" in done.stdout
    assert done.stderr.strip() == "imported: []"


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
    results = _ordered_results(chunks, 2, (sp_model, ["text"], True))
    next(results)
    assert pulled <= 10 * (2 * 2 + 2 + 1)  # the look-ahead bound; a greedy feeder would read all 1000
    results.close()
