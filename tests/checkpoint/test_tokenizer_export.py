"""Tokenizers in checkpoints and in the Hugging Face export.

References: the sentencepiece library's own encode/decode (the exported tokenizer.json, loaded by the
`tokenizers` library and by transformers' AutoTokenizer, must give its ids and text on real code, prose,
unicode and whitespace runs), and the bytes of the tokenizer files the run used.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizerLib
from transformers import AutoTokenizer

from llmtrain.checkpoint import Checkpointer, CheckpointError
from llmtrain.checkpoint.convert import from_hf, import_model, info, reshard, to_hf
from llmtrain.data import DataError, SentencePieceTokenizer, load_tokenizer
from llmtrain.data.tokenizer_export import export_hf_tokenizer
from llmtrain.models.hf import ModelFormatError
from llmtrain.parallel import Topology
from tests.checkpoint._util import build, stdlib_texts, tiny_job, train, train_tokenizer

SINGLE = Topology.single()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

UNICODE_AND_SPACES = [
    "日本語のテキストと中文混排 — ✓ émigré naïve Ünïcödé ß ﬁ ① Ｆｕｌｌｗｉｄｔｈ",
    "emoji 👩‍👩‍👧 🚀🚀 and a flag 🇫🇷, combining z\u0301alg\u0308o",
    "مرحبا بالعالم — שלום עולם — Привет, мир — Γειά σου κόσμε",
    "\t\ttabs\tand  double  spaces   and    four    ",
    " leading space, trailing spaces   ",
    "    " * 12 + "deeply_indented = True",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "a\n b\n\n  c\r\n\r\nwindows line ends",
    "digits 1234567890 3.14159e-10 0xDEADBEEF",
    "literal special tokens </s> <s> <unk> stay text",
    "",
    " ",
    "\n",
]


def _texts() -> list[str]:
    """Several hundred lines and a few whole files the tokenizer was not trained on, plus the above."""
    modules = stdlib_texts(40, 30)
    lines = [line for text in modules for line in text.split("\n")]
    return lines[:2000] + modules[:5] + UNICODE_AND_SPACES


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tok.model")


def _check_same_ids(model_file: Path, hf_dir: Path) -> int:
    """Assert tokenizer.json (tokenizers) and AutoTokenizer give sentencepiece's ids and text; count texts."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    fast = HFTokenizerLib.from_file(str(hf_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(hf_dir))
    texts = _texts()
    for text in texts:
        ids = sp.encode(text)
        assert fast.encode(text, add_special_tokens=False).ids == ids, repr(text)
        assert auto(text)["input_ids"] == ids, repr(text)  # no BOS added: training data has none
        assert auto.decode(ids) == sp.decode(ids), repr(text)
    return len(texts)


def _write(files: dict[str, bytes], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_sentencepiece_bpe_export_gives_the_same_ids(sp_model: Path, tmp_path: Path) -> None:
    exported = export_hf_tokenizer(sp_model, model_max_length=64)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert (exported.bos_token_id, exported.eos_token_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    assert sp.pad_id() == -1 and exported.pad_token_id == sp.eos_id()  # no pad piece: pad with eos
    assert exported.vocab_size == sp.get_piece_size()
    hf_dir = _write(exported.files, tmp_path / "hf")
    assert _check_same_ids(sp_model, hf_dir) >= 300
    auto = AutoTokenizer.from_pretrained(str(hf_dir))
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, 2, 2)
    assert auto.model_max_length == 64


def test_precompiled_normalisation_is_exported_exactly(tmp_path: Path) -> None:
    """A model normalised with nmt_nfkc (fullwidth letters, ligatures, ① change before encoding)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for t in stdlib_texts(0, 40) for line in t.split("\n") if line.strip()]),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        user_defined_symbols=["\n", "<tag>"],
        normalization_rule_name="nmt_nfkc",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    (tmp_path / "nfkc.model").write_bytes(model.getvalue())
    hf_dir = _write(export_hf_tokenizer(tmp_path / "nfkc.model").files, tmp_path / "hf")
    _check_same_ids(tmp_path / "nfkc.model", hf_dir)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"model_type": "unigram"}, "not a BPE model"),
        ({"add_dummy_prefix": True}, "add_dummy_prefix=true"),
        ({"remove_extra_whitespaces": True}, "remove_extra_whitespaces=true"),
    ],
)
def test_unreproducible_sentencepiece_options_are_refused(tmp_path: Path, options: dict, named: str) -> None:
    """Hugging Face's Unigram breaks ties otherwise, and a dummy prefix or whitespace collapsing cannot be
    reproduced next to added tokens: these would give other ids, so the export refuses them by name."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(stdlib_texts(0, 5)),
        model_writer=model,
        **{"vocab_size": 400, "byte_fallback": True, "add_dummy_prefix": False, "minloglevel": 2}
        | {"remove_extra_whitespaces": False}
        | options,
    )
    (tmp_path / "other.model").write_bytes(model.getvalue())
    with pytest.raises(
        DataError, match=f"cannot export SentencePiece model .*other.model.*{named}.*--tokenizer"
    ):
        export_hf_tokenizer(tmp_path / "other.model")


def test_hugging_face_tokenizer_directory_is_copied(sp_model: Path, tmp_path: Path) -> None:
    hf_dir = _write(export_hf_tokenizer(sp_model).files, tmp_path / "hf")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["pad_token"] = "<unk>"  # a pad token of its own is kept
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "chat_template.jinja").write_text("{{ messages }}")
    (hf_dir / "model.safetensors").write_bytes(b"weights are not tokenizer files")
    again = export_hf_tokenizer(hf_dir)
    assert sorted(again.files) == [
        "chat_template.jinja",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all(again.files[name] == (hf_dir / name).read_bytes() for name in again.files)
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (1, 2, 0)


def _saved_with_tokenizer(out: Path, tokenizer: object) -> Path:
    job = tiny_job(out, model__vocab_size=512)
    model, opt = build(job, SINGLE)
    train(job, SINGLE, model, opt, 0, 1)
    Checkpointer(job, SINGLE, tokenizer=tokenizer).save(1, model, opt, {"step": 1})
    return out / "checkpoints" / "step_1"


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_carries_its_tokenizer_into_the_export(sp_model: Path, tmp_path: Path, umask: int) -> None:
    own = tmp_path / "tok.model"
    shutil.copy(sp_model, own)
    step = _saved_with_tokenizer(tmp_path / "run", SentencePieceTokenizer(own))
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    assert manifest["tokenizer/tokenizer.model"]["bytes"] == own.stat().st_size
    assert info(step)["tokenizer"] == ["tokenizer.model"]
    # The checkpoint alone, copied elsewhere, exports with its tokenizer: the original file is gone.
    shutil.copytree(step, tmp_path / "copied")
    own.unlink()
    old = os.umask(umask)
    try:
        assert to_hf(tmp_path / "copied", tmp_path / "hf") == tmp_path / "copied" / "tokenizer"
    finally:
        os.umask(old)
    hf = tmp_path / "hf"
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # Every file as a plain write under this umask makes it (safetensors alone would give 0600).
    assert _modes(hf) == {p.name: 0o666 & ~umask for p in hf.iterdir()} | {"hf": 0o777 & ~umask}
    config = json.loads((hf / "config.json").read_text())
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert {k: config[k] for k in ids} == ids
    assert json.loads((hf / "generation_config.json").read_text()) == ids
    text = UNICODE_AND_SPACES[0] + stdlib_texts(50, 1)[0]
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert AutoTokenizer.from_pretrained(str(hf))(text)["input_ids"] == sp.encode(text)


def test_corrupt_tokenizer_file_fails_verification(sp_model: Path, tmp_path: Path) -> None:
    step = _saved_with_tokenizer(tmp_path / "run", SentencePieceTokenizer(sp_model))
    file = step / "tokenizer" / "tokenizer.model"
    data = bytearray(file.read_bytes())
    data[100] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tokenizer/tokenizer.model is corrupt.*load an earlier step"):
        to_hf(step, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_conversions_carry_the_tokenizer(sp_model: Path, tmp_path: Path) -> None:
    """HF dir -> checkpoint -> resharded -> HF dir, and HF dir -> llmtrain dir -> HF dir, keep the files."""
    step = _saved_with_tokenizer(tmp_path / "run", SentencePieceTokenizer(sp_model))
    reshard(step, tmp_path / "resharded", tp=2, pp=1, dp=1)
    to_hf(tmp_path / "resharded", tmp_path / "hf")
    tokenizer_files = {p.name: p.read_bytes() for p in (tmp_path / "hf").glob("*token*")}
    assert len(tokenizer_files) == 3
    from_hf(tmp_path / "hf", tmp_path / "imported", tp=2, pp=2)
    carried = load_tokenizer(tmp_path / "imported" / "checkpoints" / "step_0" / "tokenizer")
    text = UNICODE_AND_SPACES[0] + stdlib_texts(50, 1)[0]
    assert carried.encode(text) == spm.SentencePieceProcessor(model_file=str(sp_model)).encode(text)
    umask = os.umask(0)
    try:
        os.umask(0o002)  # group-writable, as on shared project directories
        import_model(tmp_path / "hf", tmp_path / "model_dir")
    finally:
        os.umask(umask)
    files = {p.name for p in (tmp_path / "model_dir").iterdir()}
    assert {"llmtrain_config.yaml", "model.safetensors", "tokenizer.json"} <= files
    assert _modes(tmp_path / "model_dir") == dict.fromkeys(files, 0o664) | {"model_dir": 0o775}
    for source, target in [("imported", "hf_again"), ("model_dir", "hf_from_model_dir")]:
        to_hf(tmp_path / source, tmp_path / target)
        assert {p.name: p.read_bytes() for p in (tmp_path / target).glob("*token*")} == tokenizer_files
    # An explicit tokenizer replaces the carried one; --no-tokenizer leaves it out.
    assert to_hf(tmp_path / "model_dir", tmp_path / "explicit", tokenizer=sp_model) == sp_model
    assert to_hf(tmp_path / "model_dir", tmp_path / "bare", include_tokenizer=False) is None
    assert not list((tmp_path / "bare").glob("*token*"))
    assert json.loads((tmp_path / "bare" / "config.json").read_text())["eos_token_id"] is None


def test_tokenizer_of_another_model_is_refused(sp_model: Path, tmp_path: Path) -> None:
    step = _saved_with_tokenizer(tmp_path / "run", None)
    big = train_tokenizer(tmp_path / "big.model", vocab_size=600)
    with pytest.raises(ModelFormatError, match="600 tokens, more than the model's vocab_size=512"):
        to_hf(step, tmp_path / "hf", tokenizer=big)
    with pytest.raises(ModelFormatError, match="tokenizer .*missing.model does not exist; give --tokenizer"):
        to_hf(step, tmp_path / "hf", tokenizer=tmp_path / "missing.model")
    assert to_hf(step, tmp_path / "hf") is None  # carries none: exported without
