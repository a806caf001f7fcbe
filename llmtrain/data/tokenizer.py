"""Tokenizers: SentencePiece models (trained here or given) and Hugging Face `tokenizer.json` directories."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from llmtrain.data.errors import DataError

# Newline is a piece of its own: the trainer sees one line per sentence and would otherwise never learn it.
NEWLINE = "\n"
SENTENCEPIECE_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
# The files of a Hugging Face tokenizer (what its save_pretrained writes); never a model's weights.
HF_TOKENIZER_FILES = (
    HF_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    SENTENCEPIECE_FILE,
)


class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def files(self) -> dict[str, bytes]:
        """The files that define this tokenizer, by their name in a tokenizer directory."""
        ...


class SentencePieceTokenizer:
    """A SentencePiece model; end of document is its `</s>` (eos) piece."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        import sentencepiece as spm

        self.path = os.fspath(model_file)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"cannot load SentencePiece model {self.path}: {e}; check data.tokenizer") from e
        self.vocab_size: int = self._sp.get_piece_size()
        self.eod_id: int = self._sp.eos_id()
        self.num_threads: int | None = (
            None  # threads of encode_batch; None: the library's default (all cores)
        )
        if self.eod_id < 0:
            raise DataError(
                f"SentencePiece model {self.path} has no end-of-sentence piece (eos_id=-1); "
                "retrain it with eos_id >= 0 (tools/train_tokenizer.py does)"
            )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-document appended)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts."""
        return self._sp.encode(texts, num_threads=self.num_threads)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self._sp.decode([int(i) for i in ids])

    def files(self) -> dict[str, bytes]:
        """The model file, as `tokenizer.model` (which load_tokenizer finds in a directory)."""
        return {SENTENCEPIECE_FILE: Path(self.path).read_bytes()}

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face fast tokenizer directory (tokenizer.json), loaded with the `tokenizers` library."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:
            raise DataError("data.tokenizer names a Hugging Face tokenizer; pip install tokenizers") from e
        p = Path(path)
        file = p / HF_TOKENIZER_FILE if p.is_dir() else p
        if not file.is_file():
            raise DataError(f"{file} not found; data.tokenizer must be a directory holding tokenizer.json")
        self.path = os.fspath(path)
        self._file = file
        self._tok = _HFTok.from_file(str(file))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id: int = self._find_eos()

    def special_token_id(self, key: str) -> int | None:
        """The id of the token configured as `key` ("bos_token", "pad_token", ...) in tokenizer_config.json
        or special_tokens_map.json; None when neither names one in the vocabulary."""
        for cfg_name in ("tokenizer_config.json", "special_tokens_map.json"):
            cfg = self._file.parent / cfg_name
            if cfg.is_file():
                token = json.loads(cfg.read_text()).get(key)
                if isinstance(token, dict):
                    token = token.get("content")
                if isinstance(token, str) and (token_id := self._tok.token_to_id(token)) is not None:
                    return token_id
        return None

    def _find_eos(self) -> int:
        configured = self.special_token_id("eos_token")
        if configured is not None:
            return configured
        for name in _EOS_CANDIDATES:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            f"cannot find an end-of-document token in {self.path}: set eos_token in its "
            "tokenizer_config.json "
            f"or add one of {list(_EOS_CANDIDATES)}"
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def files(self) -> dict[str, bytes]:
        """tokenizer.json and the tokenizer files beside it (configs, chat template, vocab files)."""
        out = {HF_TOKENIZER_FILE: self._file.read_bytes()}
        for name in HF_TOKENIZER_FILES[1:]:
            if (self._file.parent / name).is_file():
                out[name] = (self._file.parent / name).read_bytes()
        return out

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a SentencePiece `.model` file or a Hugging Face directory (or its tokenizer.json)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_dir():
        if (p / HF_TOKENIZER_FILE).is_file():
            return HFTokenizer(p)
        if (p / SENTENCEPIECE_FILE).is_file():
            return SentencePieceTokenizer(p / SENTENCEPIECE_FILE)
        raise DataError(f"{p} holds neither tokenizer.json nor tokenizer.model; point data.tokenizer at one")
    if not p.is_file():
        raise DataError(
            f"tokenizer {p} does not exist; set data.tokenizer to a .model file or tokenizer directory"
        )
    if p.suffix == ".json":
        return HFTokenizer(p)
    return SentencePieceTokenizer(p)


def _lines(documents: Iterable[str]) -> Iterator[str]:
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(
    documents: Iterable[str],
    output: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    user_defined_symbols: Iterable[str] = (),
    input_sentence_size: int = 1_000_000,
    num_threads: int = 2,
    verbose: bool = False,
) -> Path:
    """Train a byte-fallback SentencePiece model on the lines of `documents`; write it to `output` (.model).

    Normalisation is the identity and whitespace is kept as is (runs of spaces become pieces), so code
    and text round-trip exactly through encode/decode. SentencePiece's own log (its options and every
    merge, on stderr) is shown only when `verbose`.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise DataError(f"--model-type must be bpe or unigram; got {model_type!r}")
    symbols = [NEWLINE, *[s for s in user_defined_symbols if s != NEWLINE]]
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(documents),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            user_defined_symbols=symbols,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            add_dummy_prefix=False,
            split_digits=True,
            character_coverage=0.9995,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=8192,
            num_threads=num_threads,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as e:
        raise DataError(
            f"SentencePiece training with vocab_size={vocab_size} failed: {e}. A byte-fallback vocabulary "
            "needs room for 256 bytes, special tokens and the corpus' characters (use >= 512), and no "
            "more pieces than the text can fill (use more text or a smaller vocabulary)"
        ) from e
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out)
    return out
