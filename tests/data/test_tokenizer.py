"""Tokenizers: trained SentencePiece round trips, HF directories agree with transformers, errors."""

from __future__ import annotations

import pytest
import sentencepiece as spm

from llmtrain.data import DataError, HFTokenizer, SentencePieceTokenizer, load_tokenizer
from llmtrain.data.tokenizer import train_sentencepiece


def test_sentencepiece_matches_library_and_round_trips(sp_model, tokenizer, docs):
    ref = spm.SentencePieceProcessor(model_file=sp_model)
    assert tokenizer.vocab_size == ref.get_piece_size() == 512
    assert tokenizer.eod_id == ref.eos_id() >= 0
    for text in docs[:10]:
        ids = tokenizer.encode(text)
        assert ids == ref.encode(text)
        assert tokenizer.decode(ids) == text  # indentation, newlines and blank lines survive exactly
    assert tokenizer.encode_batch(docs[:3]) == [ref.encode(t) for t in docs[:3]]


def test_newline_and_unseen_characters(tokenizer):
    ids = tokenizer.encode("a\nb")
    assert tokenizer.decode(ids) == "a\nb"
    text = "日本語 ✓ \t tabs"  # unseen characters go through byte fallback
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_unigram_and_user_symbols(tmp_path, docs):
    path = train_sentencepiece(
        docs, tmp_path / "u.model", 600, model_type="unigram", user_defined_symbols=["<tag>"]
    )
    tok = SentencePieceTokenizer(path)
    ids = tok.encode("x <tag> y")
    assert tok.encode("<tag>")[0] in ids and len(tok.encode("<tag>")) == 1


def test_vocab_too_small_is_explained(tmp_path, docs):
    with pytest.raises(DataError, match="vocab_size=100.*use >= 512"):
        train_sentencepiece(docs[:3], tmp_path / "t.model", 100)


def test_hf_directory_agrees_with_transformers(hf_dir, docs):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    ours = load_tokenizer(hf_dir)
    assert isinstance(ours, HFTokenizer)
    assert ours.vocab_size == len(ref)
    assert ours.eod_id == ref.eos_token_id
    for text in docs[:5]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist; set data.tokenizer"):
        load_tokenizer(tmp_path / "missing.model")
    with pytest.raises(DataError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="cannot load SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


def test_training_is_deterministic(tmp_path, docs, sp_model):
    """Ranks on machines without a shared cache train the same tokenizer, byte for byte."""
    again = train_sentencepiece(docs, tmp_path / "again.model", 512)
    assert again.read_bytes() == open(sp_model, "rb").read()
