"""Tokenizers: trained SentencePiece round trips, HF directories agree with transformers, errors."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm

from llmtrain.data import DataError, HFTokenizer, SentencePieceTokenizer, load_tokenizer
from llmtrain.data.tokenizer import train_sentencepiece
from llmtrain.data.tokenizer_training import train_tokenizer_files


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


@pytest.mark.slow  # 2-4 s: with the whole suite, not the quick subset
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


def test_train_tokenizer_files_skips_unreadable_records_and_keeps_existing_models(tmp_path, docs):
    path = tmp_path / "in.jsonl"
    good = docs[:6]
    lines = [json.dumps({"text": d}) for d in good]
    lines.insert(2, '{"text": ')  # a damaged line among good ones
    path.write_text("\n".join(lines) + "\n")
    log = []
    out = train_tokenizer_files([str(path)], str(tmp_path / "tok"), 512, log=log.append)
    # Exactly the model SentencePiece trains on the readable documents (training is deterministic).
    assert out.read_bytes() == train_sentencepiece(good, tmp_path / "ref.model", 512).read_bytes()
    assert any(
        line.startswith("[train_tokenizer] skipping ") and "in.jsonl:3: invalid JSON" in line for line in log
    )
    assert log[-1].startswith("[train_tokenizer] 1 unreadable record skipped (first: ")
    with pytest.raises(DataError, match=r"tok\.model already exists; choose another --model-prefix"):
        train_tokenizer_files([str(path)], str(tmp_path / "tok"), 512, log=None)
    with pytest.raises(DataError, match=r"in\.jsonl:3: invalid JSON .*--on-bad-document skip"):
        train_tokenizer_files([str(path)], str(tmp_path / "t2"), 512, on_bad_document="error", log=None)
    assert not (tmp_path / "t2.model").exists()
    with pytest.raises(DataError, match=r"--input .*missing\.txt does not exist"):
        train_tokenizer_files([str(path), str(tmp_path / "missing.txt")], str(tmp_path / "t3"), 512, log=None)
    out = train_tokenizer_files([str(path)], str(tmp_path / "tok"), 600, overwrite=True, log=None)
    assert SentencePieceTokenizer(out).vocab_size == 600
