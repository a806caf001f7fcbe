"""Progress of data preparation: the lines' arithmetic and cadence, SentencePiece's silence and heartbeat,
and the one line a process waiting on another's cache prints."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import threading
import time

import pytest

from llmtrain.data import cache as cache_mod
from llmtrain.data import tokenizer as tokenizer_mod
from llmtrain.data.progress import Progress, duration, heartbeat, size, tag
from llmtrain.data.tokenizer import train_sentencepiece
from llmtrain.data.tokenizer_training import train_sentencepiece_reported


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_percentage_rate_and_eta():
    clock, lines = Clock(), []
    p = Progress("[x] tokenizing", 12_000_000, lines.append, interval=5.0, clock=clock)
    clock.now += 2.0
    p.advance(3_000_000, documents=300, tokens=1_000_000)
    # 3 MB in 2 s: 1.5 MB/s, 500k tokens/s, and the remaining 9 MB take 6 s.
    assert p.line() == (
        "[x] tokenizing: 3.00MB of 12.0MB (25%), 300 documents, 1,000,000 tokens, 1.50MB/s, 500k tokens/s, "
        "ETA 6.0 s"
    )
    p.notes = lambda: "2 empty documents skipped"
    unknown = Progress("[x] reading", None, lines.append, clock=clock)
    clock.now += 4.0
    unknown.advance(1_000_000, files=3)
    assert unknown.line() == "[x] reading: 1.00MB, 3 files, 250kB/s"  # no total: no percentage, no ETA
    assert p.line().endswith(", 500kB/s, 167k tokens/s, ETA 18 s; 2 empty documents skipped")  # 6 s in


def test_progress_prints_at_most_once_per_interval():
    clock, lines = Clock(), []
    p = Progress("[x] t", 100, lines.append, interval=5.0, clock=clock)
    for _ in range(50):  # many chunks in 4.9 s: no line
        clock.now += 0.098
        p.advance(1)
        p.tick()
    assert lines == []
    clock.now += 0.2
    p.tick()
    p.tick()
    assert len(lines) == 1 and "(50%)" in lines[0]
    silent = Progress("[x] t", 100, None, interval=0.0, clock=clock)
    silent.advance(1)
    silent.tick()  # no log: nothing to print, nothing raised


def test_sizes_durations_and_rank_tags(monkeypatch):
    assert [size(n) for n in (13, 999.6, 12_100_000, 5.1e9)] == ["13B", "1000B", "12.1MB", "5.10GB"]
    assert [duration(s) for s in (0.44, 9.96, 59.4, 200, 7500)] == [
        "0.4 s",
        "10 s",
        "59 s",
        "3 min 20 s",
        "2 h 05 min",
    ]
    monkeypatch.delenv("RANK", raising=False)
    assert tag("data") == "[data]"
    monkeypatch.setenv("RANK", "0")
    assert tag("data") == "[data]"
    monkeypatch.setenv("RANK", "5")
    assert tag("data") == "[data rank 5]"  # a cache's builder may be any rank: its lines say which


def test_heartbeat_reports_while_the_body_blocks():
    beats, third = [], threading.Event()

    def beat() -> None:
        beats.append(time.monotonic())
        if len(beats) == 3:
            third.set()

    with heartbeat(beat, period=0.01):
        assert third.wait(60)  # the body blocks until the third beat: it beat during the body
    n = len(beats)
    time.sleep(0.05)  # five periods in which a beat that outlived the body would show
    assert len(beats) == n  # it stopped with the body


def test_sentencepiece_is_silent_unless_verbose(tmp_path, docs, capfd):
    """SentencePiece logs from C++ straight to file descriptor 2: only asked for does it show."""
    train_sentencepiece(docs[:5], tmp_path / "v.model", 400, verbose=True)
    loud = capfd.readouterr()
    assert "Starts training with" in loud.err and "trainer_spec" in loud.err
    train_sentencepiece(docs[:5], tmp_path / "q.model", 400)  # after a verbose call, quiet again
    quiet = capfd.readouterr()
    assert quiet.err == "" and quiet.out == ""


def test_reported_training_says_what_and_how_long_then_beats(tmp_path, docs, monkeypatch):
    """The reporting around SentencePiece, with its one long call replaced by a blocking stand-in."""
    real = tokenizer_mod.train_sentencepiece
    events, lines, two_beats = [], [], threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if sum("still training" in line for line in lines) == 2:
            two_beats.set()

    def slow_train(documents, output, vocab_size, **kw):
        events.append(("fed", sum(1 for _ in documents)))  # SentencePiece pulls every document first
        # then trains in one call that releases the GIL: here one that blocks until two beats came
        assert two_beats.wait(60)
        return real(docs[:3], output, vocab_size, **kw)

    monkeypatch.setattr(tokenizer_mod, "train_sentencepiece", slow_train)
    path = train_sentencepiece_reported(
        docs[:3], tmp_path / "t.model", 512, log_tag="[data]", log=log, interval=0.05
    )
    assert path.is_file() and events == [("fed", 3)]
    text = sum(len(d.encode()) for d in docs[:3])
    newline_lines = sum(d.count("\n") + 1 for d in docs[:3])
    announce = lines.index(
        f"[data] read 3 documents ({size(text)} of text, {newline_lines:,} lines); "
        "SentencePiece now trains a 512-piece bpe tokenizer on them in under a second"
    )
    # Reading three documents is instant, but a busy machine may pause it past one interval.
    assert all("reading documents for the tokenizer: " in line for line in lines[:announce])
    beats = lines[announce + 1 : -1]
    assert len(beats) >= 2 and all(
        re.fullmatch(r"\[data\] SentencePiece still training: [\d.]+ s so far", b) for b in beats
    )
    assert re.fullmatch(r"\[data\] tokenizer trained in [\d.]+ s", lines[-1])


@pytest.mark.slow
def test_sentencepiece_releases_the_gil_while_training(tmp_path, docs, monkeypatch):
    """The heartbeat relies on it: a unigram model on six copies of the test corpus trains for about half a
    second on an idle machine (three copies once took only 0.23 s), longer on a busy one: some 50 beats'
    periods of 0.01 s."""
    real = tokenizer_mod.train_sentencepiece
    returned = threading.Event()

    def train(*args, **kw):
        try:
            return real(*args, **kw)
        finally:
            returned.set()

    monkeypatch.setattr(tokenizer_mod, "train_sentencepiece", train)
    corpus = [f"{i}: {doc}" for i in range(6) for doc in docs]
    lines = []
    train_sentencepiece_reported(
        corpus,
        tmp_path / "u.model",
        2000,
        model_type="unigram",
        log_tag="[t]",
        log=lambda line: lines.append((line, returned.is_set())),
        interval=0.01,
    )
    during = [line for line, after in lines if "still training" in line and not after]
    # Counted, not timed: a beat is Python, so one logged before SentencePiece's call returned ran while the
    # call had let the GIL go. Held for the whole call, at most one beat could slip in between the call's
    # return and `returned` being set (the beat then waits a period, without the GIL); two cannot.
    assert len(during) >= 2, lines


def _hold(path, rank, held, release):
    os.environ["RANK"] = rank
    with cache_mod.locked(path, "the test cache"):
        held.set()
        release.wait(60)


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_waiting_process_says_once_what_it_waits_for(tmp_path, monkeypatch, capsys, local_rank):
    """Local rank 0 names the cache and its builder once; the other ranks of the machine wait silently."""
    monkeypatch.setattr(cache_mod, "WAIT_NOTICE_S", 0.05)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    ctx = mp.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path / "c", "3", held, release))
    holder.start()
    assert held.wait(60)
    threading.Timer(0.3, release.set).start()
    assert not release.is_set()
    with cache_mod.locked(tmp_path / "c", "the test cache"):
        # Events, not a clock: asked for before the holder was released, the lock came after it.
        waited = release.is_set()
    holder.join(60)
    out = capsys.readouterr().out
    assert waited  # it did wait for the holder
    if local_rank == "0":
        assert out == (
            f"[data] waiting for pid {holder.pid} on {socket.gethostname()}, rank 3 to finish preparing "
            f"the test cache ({tmp_path / 'c'})\n"
        )
    else:
        assert out == ""
    assert not (tmp_path / "c.holder").exists()


def test_a_short_wait_is_not_announced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache_mod, "WAIT_NOTICE_S", 30.0)
    ctx = mp.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path / "c", "1", held, release))
    holder.start()
    assert held.wait(60)
    threading.Timer(0.3, release.set).start()  # the holder lets go well within WAIT_NOTICE_S
    assert not release.is_set()
    with cache_mod.locked(tmp_path / "c", "the test cache"):
        assert release.is_set()  # it waited for the holder, who lets go only once released
    holder.join(60)
    assert capsys.readouterr().out == ""
