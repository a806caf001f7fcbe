"""Shared fixtures of the data tests: a small real-text corpus, a tokenizer trained on it, a dataset."""

from __future__ import annotations

import json
import sysconfig
import warnings
from pathlib import Path

import pytest

from llmtrain.data.preprocess import preprocess_documents
from llmtrain.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

VOCAB = 512


@pytest.fixture(scope="session")
def docs() -> list[str]:
    """About 150 kB of real text: the first top-level modules of the standard library, whole."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip() and len(text) < 40_000:
            out.append(text)
            total += len(text)
        if total > 150_000:
            break
    return out


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, docs) -> str:
    """A 512-piece byte-fallback BPE SentencePiece model trained on `docs`."""
    return str(train_sentencepiece(docs, tmp_path_factory.mktemp("tok") / "tok.model", VOCAB))


@pytest.fixture(scope="session")
def tokenizer(sp_model):
    return SentencePieceTokenizer(sp_model)


@pytest.fixture(scope="session")
def dataset_prefix(tmp_path_factory, docs, sp_model) -> str:
    """`docs` preprocessed (with end-of-document tokens) into an indexed dataset."""
    prefix = str(tmp_path_factory.mktemp("ds") / "docs")
    preprocess_documents(docs, prefix, sp_model)
    return prefix


@pytest.fixture(scope="session")
def mcore_indexed():
    """megatron-core's indexed_dataset module, the reference implementation of the file format."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets import indexed_dataset
        except Exception as e:  # noqa: BLE001 - any import failure means the reference is unavailable
            pytest.skip(
                f"megatron-core cannot be imported ({type(e).__name__}: {e}); pip install megatron-core"
            )
    return indexed_dataset


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, docs) -> Path:
    """A Hugging Face byte-level BPE tokenizer directory (400 tokens, eos <|endoftext|>) trained on `docs`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|endoftext|>"])
    tok.train_from_iterator(docs, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder
