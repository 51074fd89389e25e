"""Files from elsewhere are never unpickled, and every damaged or mismatched file is a clear
CheckpointError naming the file, never a crash deep inside torch."""

from __future__ import annotations

import ast
import os
import json
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diff_transformer.checkpoint import CheckpointError, load_checkpoint_tokenizer
from diff_transformer.config import ModelConfig
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A valid debug checkpoint with the byte tokenizer; each test damages a copy."""
    directory = tmp_path_factory.mktemp("safety") / "ckpt"
    LanguageModel(ModelConfig.from_preset("debug")).save_pretrained(directory, ByteTokenizer())
    return directory


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def _edit_config(directory: Path, edit) -> None:
    meta = json.loads((directory / "config.json").read_text())
    edit(meta)
    (directory / "config.json").write_text(json.dumps(meta))


# --- weights ------------------------------------------------------------------------------


def _truncate_half(b: bytes) -> bytes:
    return b[: len(b) // 2]


def _garble_header(b: bytes) -> bytes:
    return b[:8] + b"\xff" * 32 + b[40:]


def _huge_header_length(b: bytes) -> bytes:
    return (2**62).to_bytes(8, "little") + b[8:]


def _pickle_in_disguise(b: bytes) -> bytes:
    return pickle.dumps({"embed.weight": [0.0] * 4})


@pytest.mark.parametrize(
    "damage",
    [_truncate_half, lambda b: b[:20], lambda b: b"", _garble_header, _huge_header_length, _pickle_in_disguise,
     lambda b: b + b"trailing bytes", lambda b: random.Random(13).randbytes(len(b))],
    ids=["truncated", "header-cut", "empty", "garbled-header", "huge-header-length", "pickle", "trailing-bytes",
         "random-bytes"],
)  # fmt: skip
def test_damaged_safetensors_is_a_clear_error(copy, damage):
    weights = copy / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupted safetensors file"):
        LanguageModel.from_pretrained(copy)


def test_nan_payload_is_a_clear_error(copy):
    """safetensors has no checksum; damaged payload bytes that decode to NaN/Inf are caught."""
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # the end of the last tensor: fp32 0xffffffff is NaN
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted weights, NaN or Inf values in \w"):
        LanguageModel.from_pretrained(copy)


def test_missing_weights_file(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weights file is missing"):
        LanguageModel.from_pretrained(copy)


def test_weights_that_do_not_fit_the_config_are_named(copy):
    _edit_config(copy, lambda meta: meta["model"].update(ffn_hidden=128))
    with pytest.raises(CheckpointError,
                       match=r"shape mismatch: layers\.0\.ffn\.down_proj\.weight: \(64, 192\) in .*model\.safetensors"):
        LanguageModel.from_pretrained(copy)


def test_missing_and_foreign_tensors_are_named(copy):
    from safetensors.torch import load_file

    state = load_file(str(copy / "model.safetensors"))
    state.pop("norm.weight")
    state["layers.0.attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"missing from .*: norm\.weight \| not in the model: layers\.0\.attn\.q_proj\.bias"):
        LanguageModel.from_pretrained(copy)


# --- config.json --------------------------------------------------------------------------


def test_config_from_a_newer_format_version(copy):
    _edit_config(copy, lambda meta: meta.update(format_version=meta["format_version"] + 1))
    with pytest.raises(CheckpointError, match=r"config\.json: format_version 2 is newer than this library reads \(1\)"):
        LanguageModel.from_pretrained(copy)


def test_config_without_format_version(copy):
    _edit_config(copy, lambda meta: meta.pop("format_version"))
    with pytest.raises(CheckpointError, match=r"config\.json: format_version must be an integer, got None"):
        LanguageModel.from_pretrained(copy)


def test_config_with_an_unknown_field(copy):
    _edit_config(copy, lambda meta: meta["model"].update(n_experts=8))
    with pytest.raises(CheckpointError,
                       match=r"config\.json: invalid model config: unknown ModelConfig field\(s\): n_experts"):
        LanguageModel.from_pretrained(copy)


def test_config_with_an_invalid_value(copy):
    _edit_config(copy, lambda meta: meta["model"].update(n_heads=0))
    with pytest.raises(CheckpointError,
                       match=r"config\.json: invalid model config: n_heads must be a positive integer"):
        LanguageModel.from_pretrained(copy)


@pytest.mark.parametrize(
    "field, value, message",
    [("d_model", "64", r"d_model must be a positive integer, got '64'"),
     ("n_layers", None, r"n_layers must be a positive integer, got None"),
     ("rope_theta", [1, 2], r"'<=' not supported|rope_theta"),
     ("attention", "mamba", r"attention must be one of")],
    ids=["string-for-int", "null", "list-for-float", "unknown-kind"],
)
def test_config_with_a_wrong_type(copy, field, value, message):
    _edit_config(copy, lambda meta: meta["model"].update({field: value}))
    with pytest.raises(CheckpointError, match=r"config\.json: invalid model config: .*(" + message + ")"):
        LanguageModel.from_pretrained(copy)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]"],
                         ids=["bad-json", "not-utf8", "not-object"])
def test_unreadable_config(copy, content):
    (copy / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"config\.json: not"):
        LanguageModel.from_pretrained(copy)


def test_a_transformers_directory_is_not_a_checkpoint(copy):
    (copy / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match=r"config\.json: not a diff-transformer config"):
        LanguageModel.from_pretrained(copy)


# --- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_larger_than_the_vocabulary(copy):
    """A 257-token tokenizer beside a model whose vocab_size (200) cannot hold its ids."""
    _edit_config(copy, lambda meta: meta["model"].update(vocab_size=200))
    with pytest.raises(CheckpointError, match=r"tokenizer has 257 tokens but the model's vocab_size is 200"):
        load_checkpoint_tokenizer(copy, vocab_size=200)
    with pytest.raises(CheckpointError, match=r"tokenizer has 257 tokens but the model's vocab_size is 200"):
        LanguageModel(ModelConfig.from_preset("debug", vocab_size=200)).save_pretrained(
            copy.parent / "new", ByteTokenizer())


def test_export_checks_the_tokenizer_against_the_vocabulary(copy, tmp_path):
    pytest.importorskip("transformers")
    from diff_transformer.interop.hf import export_hf

    state = LanguageModel(ModelConfig.from_preset("debug", vocab_size=200)).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(copy / "model.safetensors"))
    _edit_config(copy, lambda meta: meta["model"].update(vocab_size=200))
    with pytest.raises(CheckpointError, match=r"tokenizer has 257 tokens but the model's vocab_size is 200"):
        export_hf(copy, tmp_path / "hf")


@pytest.mark.parametrize(
    "name, content",
    [("tokenizer_config.json", "{broken"), ("tokenizer_config.json", '{"type": "wordpiece"}'),
     ("tokenizer.json", '{"x": 1}'), ("tokenizer.json", "[1, 2, 3]"), ("tokenizer.json", os.urandom(64).hex())],
    ids=["bad-json", "unknown-type", "bad-tokenizers-file", "json-list", "random-text"],
)
def test_unreadable_tokenizer(copy, name, content):
    (copy / name).write_text(content)
    with pytest.raises(CheckpointError, match=r"ckpt: unreadable tokenizer"):
        load_checkpoint_tokenizer(copy, vocab_size=512)


# --- Hugging Face directories -------------------------------------------------------------


@pytest.fixture
def no_unpickling(monkeypatch):
    """Make every unpickling entry point fail the test if it is reached."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a file was unpickled")

    for module, name in [(torch, "load"), (pickle, "load"), (pickle, "loads")]:
        monkeypatch.setattr(module, name, forbidden)


def test_import_refuses_pickled_weights(tmp_path, no_unpickling):
    pytest.importorskip("transformers")
    from diff_transformer.interop.hf import import_hf, save_hf

    save_hf(LanguageModel(ModelConfig.from_preset("debug")), tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be opened")
    with pytest.raises(CheckpointError, match=r"only pickled weights \(pytorch_model\.bin\), which are never loaded"):
        import_hf(tmp_path / "hf", tmp_path / "out")


@pytest.mark.parametrize("damaged", ["model.safetensors", "config.json"])
def test_import_damaged_transformers_directory(tmp_path, damaged, no_unpickling):
    pytest.importorskip("transformers")
    from diff_transformer.interop.hf import import_hf, save_hf

    save_hf(LanguageModel(ModelConfig.from_preset("debug")), tmp_path / "hf")
    path = tmp_path / "hf" / damaged
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=damaged.replace(".", r"\.")):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- the source tree ----------------------------------------------------------------------


def _unsafe_loads(path: Path) -> list[str]:
    """Calls in a Python file that may unpickle: torch.load without weights_only=True,
    pickle/dill/cloudpickle load(s), numpy.load with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        keywords = {k.arg: k.value for k in node.keywords}
        is_true = lambda name, keywords=keywords: (  # noqa: E731
            isinstance(keywords.get(name), ast.Constant) and keywords[name].value is True)
        where = f"{path.relative_to(REPO)}:{node.lineno}"
        if owner == "torch" and node.func.attr == "load" and not is_true("weights_only"):
            found.append(f"{where} torch.load without weights_only=True")
        elif owner in ("pickle", "dill", "cloudpickle", "joblib") and node.func.attr in ("load", "loads"):
            found.append(f"{where} {owner}.{node.func.attr}")
        elif owner in ("np", "numpy") and node.func.attr == "load" and is_true("allow_pickle"):
            found.append(f"{where} numpy.load with allow_pickle=True")
    return found


@pytest.mark.slow  # reads every source file (2 s)
def test_no_code_in_the_package_unpickles():
    files = [p for folder in ("src", "scripts") for p in (REPO / folder).rglob("*.py")]
    assert files
    assert [hit for p in files for hit in _unsafe_loads(p)] == []


def test_the_unpickling_scan_finds_unsafe_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch, pickle, numpy as np\n"
        "torch.load('a')\ntorch.load('b', weights_only=True)\ntorch.load('c', weights_only=False)\n"
        "pickle.loads(b'')\nnp.load('d', allow_pickle=True)\nnp.load('e')\n"
    )
    hits = _unsafe_loads(sample)
    assert [h.split()[0] for h in hits] == ["sample.py:2", "sample.py:4", "sample.py:5", "sample.py:6"]



# --- training state -----------------------------------------------------------------------


class _Payload:
    """Unpickling this would create the file named by ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_training_state_with_a_pickle_payload_is_refused_unopened(tmp_path):
    from diff_transformer.train.state import TRAINING_STATE_FILE, read_training_state

    marker = tmp_path / "payload-ran"
    torch.save({"version": 1, "progress": _Payload(str(marker))}, tmp_path / TRAINING_STATE_FILE)
    with pytest.raises(CheckpointError, match=r"training_state\.pt: unreadable training state \(UnpicklingError"):
        read_training_state(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content", [b"", os.urandom(512), pickle.dumps([1, 2, 3])], ids=["empty", "random-bytes", "plain-list"]
)
def test_a_damaged_training_state_is_a_clear_error(tmp_path, content):
    from diff_transformer.train.state import TRAINING_STATE_FILE, read_training_state

    (tmp_path / TRAINING_STATE_FILE).write_bytes(content)
    with pytest.raises(CheckpointError,
                       match=r"training_state\.pt: (unreadable training state|not a version-1 training state)"):
        read_training_state(tmp_path)


def test_a_training_state_missing_its_parts_is_refused(tmp_path):
    from diff_transformer.train.state import TRAINING_STATE_FILE, read_training_state

    torch.save({"version": 1, "progress": {"step": 1, "samples": 8, "tokens": 256}}, tmp_path / TRAINING_STATE_FILE)
    with pytest.raises(CheckpointError, match=r"not a complete training state \(no optimizer, schedule, rng\)"):
        read_training_state(tmp_path)
