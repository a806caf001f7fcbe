"""The built-in default corpus: the Python standard library's own sources, present on every machine.

First use trains a SentencePiece tokenizer on it (unless one is given) and preprocesses it into an
indexed dataset; both are cached under data.cache_dir, keyed by the corpus, the vocabulary size and the
tokenizer options, and built once even when several ranks start together.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from llmtrain.data.cache import build_dir_once, file_identity, fingerprint
from llmtrain.data.errors import DataError
from llmtrain.data.preprocess import preprocess_documents
from llmtrain.data.progress import INTERVAL_S, Log, Progress, duration, say, size, tag
from llmtrain.data.tokenizer_training import train_sentencepiece_reported

CORPORA = ("stdlib",)
_CORPUS_VERSION = 1  # bump when file selection or tokenizer options change
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test", "test", "tests"}
MAX_CORPUS_BYTES = 64 << 20  # guards preparation time on unusually large installations
MAX_TRAINED_VOCAB = 32768  # a corpus of ~12 MB cannot fill a larger vocabulary usefully


@dataclass
class Corpus:
    """A prepared corpus: its dataset prefix, its tokenizer and what preparing it measured."""

    prefix: str
    tokenizer: str
    meta: dict


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the stdlib's .py files outside tests, in a fixed pseudo-random order.

    The order is by a hash of the relative path, so the contiguous valid split is a random sample of
    modules rather than the alphabetically last package.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (often far bigger than the stdlib).
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith("test"))
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda f: hashlib.sha1(f[0].encode()).hexdigest())
    return files


def _read_documents(files: list[tuple[str, Path]], progress: Progress | None = None) -> list[str]:
    docs, total = [], 0
    for _, path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if progress is not None:
            progress.advance(path.stat().st_size, files=1)
            progress.tick()
        if text.strip():
            docs.append(text)
            total += len(text)
            if total >= MAX_CORPUS_BYTES:
                break
    return docs


def _tokenizer_identity(path: str) -> list:
    p = Path(os.path.expanduser(path))
    for name in ("tokenizer.json", "tokenizer.model"):
        if p.is_dir() and (p / name).is_file():
            return file_identity(p / name)
    return file_identity(p)


def prepare_corpus(
    name: str,
    cache_dir: str | os.PathLike,
    vocab_size: int,
    tokenizer: str | None = None,
    log: Log | None = say,
    interval: float = INTERVAL_S,
) -> Corpus:
    """Prepare (or find cached) the built-in corpus `name` for a model vocabulary of vocab_size.

    The process that builds it reports each step (reading, tokenizer training, tokenizing) with progress
    lines every `interval` seconds; other processes wait for it, and one of them per machine says so.
    """
    if name not in CORPORA:
        raise DataError(
            f"data.corpus={name!r} is not a built-in corpus ({', '.join(CORPORA)}); or set data.prefixes"
        )
    files = stdlib_files()
    if not files:
        raise DataError(
            f"no .py files under {sysconfig.get_paths()['stdlib']}; set data.prefixes to your data"
        )
    trained_vocab = min(vocab_size, MAX_TRAINED_VOCAB)
    key = fingerprint(
        name,
        _CORPUS_VERSION,
        sys.version_info[:3],
        MAX_CORPUS_BYTES,
        [(rel, p.stat().st_size) for rel, p in files],
        _tokenizer_identity(tokenizer) if tokenizer else ("sentencepiece-bpe", trained_vocab),
    )
    root = Path(os.path.expanduser(os.fspath(cache_dir))) / "corpus"
    root.mkdir(parents=True, exist_ok=True)
    prefix = tag("data")
    what = f"the {name} corpus"

    def build(tmp: Path) -> None:
        steps = "tokenizing" if tokenizer else "training a tokenizer on it and tokenizing"
        if log:
            log(f"{prefix} first use of {what}: {steps} it in {root} (cached for later runs)")
        start = time.perf_counter()
        reading = Progress(
            f"{prefix} reading {len(files):,} files of {sysconfig.get_paths()['stdlib']}",
            sum(p.stat().st_size for _, p in files),
            log,
            interval,
        )
        docs = _read_documents(files, reading)
        tok_path = tokenizer or str(
            train_sentencepiece_reported(
                docs, tmp / "tokenizer.model", trained_vocab, log_tag=prefix, log=log, interval=interval
            )
        )
        tok_seconds = time.perf_counter() - start
        stats = preprocess_documents(
            docs, str(tmp / "corpus"), tok_path, workers=1, log=log, log_interval=interval, name=what
        )
        meta = {
            "corpus": name,
            "documents": stats.documents,
            "tokens": stats.tokens,
            "bytes": sum(len(d.encode()) for d in docs),
            "tokenizer_seconds": round(tok_seconds, 2),
            "prepare_seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if log:
            log(
                f"{prefix} {what} ready: {stats.documents:,} documents, {size(meta['bytes'])}, "
                f"{stats.tokens:,} tokens, prepared in {duration(meta['prepare_seconds'])}"
            )

    folder = build_dir_once(root / f"{name}-{key}", build, what)
    tok = tokenizer or str(folder / "tokenizer.model")
    return Corpus(str(folder / "corpus"), tok, json.loads((folder / "meta.json").read_text()))
