"""A tokenizer as Hugging Face tokenizer files, so that `AutoTokenizer.from_pretrained` gives our token ids.

A Hugging Face tokenizer is exported as its own files. A SentencePiece BPE model is rebuilt with the
`tokenizers` library (an install dependency; transformers is not needed):
- the pieces, in id order, are the vocabulary; every split of a piece into two pieces is a merge, ranked
  by the piece's score (SentencePiece merges the adjacent pair making the highest-scoring piece first,
  leftmost on ties; Hugging Face's BPE the pair of lowest rank first, leftmost on ties);
- spaces become "▁", characters outside the vocabulary fall back to their UTF-8 bytes (<0xNN> pieces),
  a precompiled normalisation (nmt_nfkc, ...) is the same charsmap run by `normalizers.Precompiled`;
- user-defined pieces (our "\\n") are added tokens, matched whole before BPE as SentencePiece does;
- control pieces (<s>, </s>) and <unk> are in the vocabulary but are not added tokens: SentencePiece
  spells "</s>" in text out as characters, and so does the exported tokenizer (for transformers, which
  adds the special tokens named in tokenizer_config.json itself, through split_special_tokens).
For the options tools/train_tokenizer.py trains with (identity or precompiled normalisation, no dummy
prefix, whitespace kept) this gives sentencepiece's ids on every text checked (thousands of lines of code,
prose, unicode and whitespace runs: tests/checkpoint/test_tokenizer_export.py). Models with other options
are refused by name rather than exported with different ids: a dummy prefix or whitespace collapsing cannot
be reproduced at the boundaries of added tokens, and Hugging Face's Unigram breaks ties between equally
scored segmentations differently from SentencePiece's. Decoding differs in one corner: a run of byte
pieces that is not valid UTF-8 becomes one U+FFFD per byte in Hugging Face's ByteFallback, while
sentencepiece keeps the valid bytes of the run (ids from encoding text never form such runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from llmtrain.data.errors import DataError
from llmtrain.data.tokenizer import HF_TOKENIZER_FILE, HFTokenizer, SentencePieceTokenizer, load_tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPACE = "\u2581"

# sentencepiece_model.proto's enums.
_BPE = 2
_NORMAL, _UNKNOWN, _USER_DEFINED, _UNUSED = 1, 2, 4, 5


@dataclasses.dataclass(frozen=True)
class HFTokenizerFiles:
    """A tokenizer as the files of a Hugging Face tokenizer directory, with the special-token ids that a
    model's config.json and generation_config.json record."""

    files: dict[str, bytes]
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int

    def token_ids(self) -> dict[str, int | None]:
        """bos/eos/pad ids under the keys transformers' configs use."""
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


def export_hf_tokenizer(path: str | os.PathLike, model_max_length: int | None = None) -> HFTokenizerFiles:
    """The Hugging Face files of the tokenizer at `path`: a SentencePiece .model file, a tokenizer.json,
    or a directory holding tokenizer.model or tokenizer.json (a checkpoint's tokenizer/ directory).

    A tokenizer without a pad token pads with its end-of-sequence token, as LLaMA-family exports do: a
    separate pad token would need an embedding row the model does not have, and transformers' generate
    falls back to eos for padding anyway.
    """
    tok = load_tokenizer(path)
    if isinstance(tok, HFTokenizer):
        pad = tok.special_token_id("pad_token")
        return HFTokenizerFiles(
            tok.files(),
            vocab_size=tok.vocab_size,
            bos_token_id=tok.special_token_id("bos_token"),
            eos_token_id=tok.eod_id,
            pad_token_id=tok.eod_id if pad is None else pad,
        )
    assert isinstance(tok, SentencePieceTokenizer)
    return _from_sentencepiece(Path(tok.path), model_max_length)


def _from_sentencepiece(model_file: Path, model_max_length: int | None) -> HFTokenizerFiles:
    proto = _read_proto(model_file)
    _check_convertible(proto, model_file)
    pieces = list(proto.pieces)
    unk = next(i for i, p in enumerate(pieces) if p.type == _UNKNOWN)
    specials = {
        "bos_token": proto.trainer_spec.bos_id,
        "eos_token": proto.trainer_spec.eos_id,
        "unk_token": unk,
        "pad_token": proto.trainer_spec.pad_id
        if proto.trainer_spec.pad_id >= 0
        else proto.trainer_spec.eos_id,
    }
    names = {key: pieces[i].piece for key, i in specials.items() if 0 <= i < len(pieces)}
    tokenizer_json = _build_bpe(proto).to_str(pretty=True)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "clean_up_tokenization_spaces": False,
        # SentencePiece encodes the text "</s>" as characters, not as the eos id; so must the export.
        "split_special_tokens": True,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    files = {
        HF_TOKENIZER_FILE: tokenizer_json.encode(),
        TOKENIZER_CONFIG: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode(),
        SPECIAL_TOKENS_MAP: (json.dumps(names, indent=2, ensure_ascii=False) + "\n").encode(),
    }
    bos = specials["bos_token"]
    return HFTokenizerFiles(
        files,
        vocab_size=len(pieces),
        bos_token_id=bos if bos >= 0 else None,
        eos_token_id=specials["eos_token"],
        pad_token_id=specials["pad_token"],
    )


def _read_proto(model_file: Path) -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as err:  # the generated module needs protobuf
        raise DataError(
            f"reading {model_file} for the Hugging Face export needs protobuf ({err}); pip install protobuf"
        ) from err
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    return proto


def _check_convertible(proto: Any, model_file: Path) -> None:
    """Raise naming the first option whose SentencePiece behaviour the export would not reproduce."""
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if spec.model_type != _BPE:
        problems.append("it is not a BPE model (Hugging Face's Unigram breaks ties differently)")
    if norm.add_dummy_prefix:
        problems.append("it adds a dummy prefix (add_dummy_prefix=true)")
    if norm.remove_extra_whitespaces:
        problems.append("it collapses whitespace (remove_extra_whitespaces=true)")
    if not norm.escape_whitespaces:
        problems.append("it does not escape whitespace (escape_whitespaces=false)")
    if proto.denormalizer_spec.precompiled_charsmap:
        problems.append("it has a denormalizer")
    if any(p.type == _UNUSED for p in proto.pieces):
        problems.append("it has unused pieces")
    if not any(p.type == _UNKNOWN for p in proto.pieces):
        problems.append("it has no <unk> piece")
    if not 0 <= spec.eos_id < len(proto.pieces):
        problems.append("it has no end-of-sequence piece (eos_id=-1)")
    if problems:
        raise DataError(
            f"cannot export SentencePiece model {model_file} as a Hugging Face tokenizer with the same ids: "
            f"{'; '.join(problems)}. Train it with tools/train_tokenizer.py (BPE), or export with a Hugging "
            "Face tokenizer directory of it (--tokenizer DIR)"
        )


def _build_bpe(proto: Any) -> Any:
    """The `tokenizers.Tokenizer` that encodes and decodes as the SentencePiece BPE model `proto`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    mergeable = {p.piece for p in pieces if p.type == _NORMAL}
    ranked = []
    for i, p in enumerate(pieces):
        if p.type != _NORMAL:
            continue
        s = p.piece
        splits = [(s[:k], s[k:]) for k in range(1, len(s)) if s[:k] in mergeable and s[k:] in mergeable]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(-p.score, i, left, right) for left, right in splits]
    ranked.sort(key=lambda m: (m[0], m[1]))
    unk = next(p.piece for p in pieces if p.type == _UNKNOWN)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    steps = [normalizers.Replace(" ", SPACE)]
    if proto.normalizer_spec.precompiled_charsmap:
        steps.insert(0, normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens(
        [AddedToken(p.piece, special=False, normalized=False) for p in pieces if p.type == _USER_DEFINED]
    )
    return tok
