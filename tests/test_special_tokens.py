"""Real tokenizers: the end-of-text and begin tokens are read from the files beside a tokenizer.json
(tokenizer_config.json's eos_token / bos_token, else config.json's ids, else <|endoftext|>) or named
with --eos-token / --bos-token, so `prepare --tokenizer path/to/llama/tokenizer.json` works with
Llama-style (<|begin_of_text|>, <|end_of_text|>) and Qwen-style (<|endoftext|>, <|im_end|>) tokenizers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diff_transformer.cli import main as cli_main
from diff_transformer.data import prepare
from diff_transformer.tokenizer import BPETokenizer, load_tokenizer, same_tokenizer
from motif_fixtures import LLAMA_SPECIALS, QWEN_SPECIALS, write_tokenizer

DOCS = ["the quick brown fox", "jumps over the lazy dog", "differential attention cancels noise"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return path


def _ids(tokenizer_json, token):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).token_to_id(token)


def _documents_end_with(directory, eos_id, dtype=np.uint16):
    ids = np.concatenate([np.fromfile(directory / f"{split}.bin", dtype=dtype) for split in ("train", "val")])
    return int((ids == eos_id).sum()) == len(DOCS) and ids[-1] == eos_id


def test_prepare_with_a_llama_style_tokenizer_reads_its_special_tokens(corpus, tmp_path, capsys):
    tok = write_tokenizer(tmp_path / "llama", LLAMA_SPECIALS, eos="<|end_of_text|>", bos="<|begin_of_text|>")
    assert cli_main(["prepare", str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "data"),
                     "--val-fraction", "0.3", "--quiet"]) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["eos_id"] == _ids(tok, "<|end_of_text|>")
    assert _documents_end_with(tmp_path / "data", meta["eos_id"])
    stored = load_tokenizer(tmp_path / "data")  # the dataset keeps the tokenizer with its special tokens
    assert (stored.eos_token, stored.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")
    assert stored.bos_id == _ids(tok, "<|begin_of_text|>")
    assert same_tokenizer(stored, BPETokenizer(tok))


def test_a_qwen_style_tokenizer_takes_what_its_config_names_or_the_option(corpus, tmp_path):
    tok = write_tokenizer(tmp_path / "qwen", QWEN_SPECIALS, eos="<|im_end|>", bos=None)
    named = BPETokenizer(tok)
    assert (named.eos_token, named.bos_id) == ("<|im_end|>", None)
    meta = prepare([corpus], tmp_path / "data", tokenizer=tok, eos_token="<|endoftext|>", progress=False,
                   val_fraction=0.3)
    assert meta["eos_id"] == _ids(tok, "<|endoftext|>")
    assert _documents_end_with(tmp_path / "data", meta["eos_id"])
    assert load_tokenizer(tmp_path / "data").eos_token == "<|endoftext|>"


def test_ids_in_a_config_json_beside_it_name_the_tokens(tmp_path):
    tok = write_tokenizer(tmp_path / "model", LLAMA_SPECIALS, eos="<|end_of_text|>", bos="<|begin_of_text|>",
                          config_ids=True)
    assert not (tmp_path / "model" / "tokenizer_config.json").exists()
    read = BPETokenizer(tok)
    assert (read.eos_token, read.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")


def test_ids_in_a_config_json_that_name_ordinary_tokens_are_not_taken(tmp_path):
    """transformers writes its default ids (bos 1, eos 2) into the config of a model built beside any
    tokenizer: where they name ordinary tokens ('!' and '"' here) they are not special tokens."""
    tok = write_tokenizer(tmp_path / "model", QWEN_SPECIALS, eos=None, bos=None)
    (tmp_path / "model" / "tokenizer_config.json").unlink()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"bos_token_id": 100, "eos_token_id": 101}))
    read = BPETokenizer(tok)
    assert (read.eos_token, read.bos_token) == ("<|endoftext|>", None)


def test_without_an_end_of_text_token_the_error_names_the_file_and_the_option(corpus, tmp_path, capsys):
    tok = write_tokenizer(tmp_path / "bare", LLAMA_SPECIALS, eos=None, bos=None)
    with pytest.raises(ValueError, match=r"tokenizer\.json: no end-of-text token.*--eos-token"):
        BPETokenizer(tok)
    assert cli_main(["prepare", str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "--eos-token" in err and "Traceback" not in err and not (tmp_path / "data").exists()
    assert cli_main(["prepare", str(corpus), "--tokenizer", str(tok), "--eos-token", "<|end_of_text|>",
                     "--out", str(tmp_path / "data"), "--val-fraction", "0.3", "--quiet"]) == 0


def test_a_named_token_missing_from_the_vocabulary_is_refused(tmp_path):
    tok = write_tokenizer(tmp_path / "llama", LLAMA_SPECIALS, eos="<|eot_id|>", bos=None)
    with pytest.raises(ValueError, match=r"eos token '<\|eot_id\|>' \(from .*tokenizer_config\.json \(eos_token\)\) "
                                         r"is not in its vocabulary"):
        BPETokenizer(tok)
    with pytest.raises(ValueError, match=r"bos token '<s>' \(from --bos-token '<s>'\)"):
        BPETokenizer(tok, eos_token="<|end_of_text|>", bos_token="<s>")
    with pytest.raises(ValueError, match="name those of a tokenizers JSON file"):
        load_tokenizer("bytes", eos_token="<|end_of_text|>")


def test_import_hf_names_the_tokens_too(tmp_path):
    from motif_fixtures import make_tiny_motif_dir

    source = make_tiny_motif_dir(tmp_path / "motif", "2.6b")
    assert cli_main(["import-hf", str(source), str(tmp_path / "ckpt"), "--eos-token", "<|begin_of_text|>",
                     "--bos-token", "<|end_of_text|>"]) == 0
    stored = load_tokenizer(tmp_path / "ckpt")
    assert (stored.eos_token, stored.bos_token) == ("<|begin_of_text|>", "<|end_of_text|>")


def test_generate_starts_from_the_begin_token_of_a_released_tokenizer(tmp_path, capsys):
    """A checkpoint whose tokenizer has a begin token (an imported Llama's or Motif's): `generate`
    puts it before the prompt, as that model saw every sequence begin; the greedy tokens equal the
    model's own continuation of [begin] + prompt."""
    from diff_transformer import LanguageModel
    from motif_fixtures import make_tiny_motif_dir

    source = make_tiny_motif_dir(tmp_path / "motif", "2.6b")
    assert cli_main(["import-hf", str(source), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "ckpt"), "--prompt", "the quick", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(tmp_path / "ckpt")
    model = LanguageModel.from_pretrained(tmp_path / "ckpt").eval()
    expected = model.generate([[tokenizer.bos_id, *tokenizer.encode("the quick")]], 6, temperature=0,
                              stop_tokens=[tokenizer.eos_id], vocab_limit=tokenizer.vocab_size)[0]
    expected = expected[: expected.index(tokenizer.eos_id)] if tokenizer.eos_id in expected else expected
    assert out == "the quick" + tokenizer.decode(expected) + "\n"
