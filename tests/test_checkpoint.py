"""Checkpoint directories: round trip, atomic replacement, mismatches named."""

import json
import os
import stat

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.checkpoint import (
    CheckpointError,
    load_checkpoint_tokenizer,
    load_state_dict_checked,
    write_directory_atomically,
)
from diff_transformer.tokenizer import ByteTokenizer


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise", "mta",
                                  "xsa"])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip(tmp_path, kind, tied):
    config = ModelConfig.from_preset("debug", attention=kind, vocab_size=257, tie_embeddings=tied)
    model = LanguageModel(config)
    out = model.save_pretrained(tmp_path / "ckpt", tokenizer=ByteTokenizer())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["format_version"] == 1 and meta["model"]["attention"] == kind
    loaded = LanguageModel.from_pretrained(out)
    assert loaded.config == config
    tokens = torch.randint(0, 257, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], atol=0, rtol=0)
    assert isinstance(load_checkpoint_tokenizer(out, config.vocab_size), ByteTokenizer)


def test_save_replaces_atomically_and_leaves_no_temporaries(tmp_path):
    a = LanguageModel(ModelConfig.from_preset("debug"))
    b = LanguageModel(ModelConfig.from_preset("debug"))
    a.save_pretrained(tmp_path / "ckpt")
    b.save_pretrained(tmp_path / "ckpt", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert torch.equal(LanguageModel.from_pretrained(tmp_path / "ckpt").embed.weight, b.embed.weight)


def test_checkpoint_permissions_follow_the_umask(tmp_path):
    old_mask = os.umask(0o022)
    try:
        out = LanguageModel(ModelConfig.from_preset("debug")).save_pretrained(tmp_path / "ckpt")
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o644}


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path):
    model = LanguageModel(ModelConfig.from_preset("debug"))
    model.save_pretrained(tmp_path / "ckpt")

    def crash(tmp):
        (tmp / "config.json").write_text("{ half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_directory_atomically(tmp_path / "ckpt", crash, kind="checkpoint", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert torch.equal(LanguageModel.from_pretrained(tmp_path / "ckpt").embed.weight, model.embed.weight)


def test_weights_into_a_different_config_name_the_mismatch(tmp_path):
    diff = LanguageModel(ModelConfig.from_preset("debug", attention="diff"))
    std = LanguageModel(ModelConfig.from_preset("debug", attention="standard"))
    with pytest.raises(CheckpointError, match=r"not in the model: layers\.0\.attn\.head_norm\.weight"):
        load_state_dict_checked(std, diff.state_dict())
    wider = LanguageModel(ModelConfig.from_preset("debug", d_model=128, n_heads=4))
    with pytest.raises(CheckpointError, match=r"shape mismatch: embed\.weight: \(512, 64\) in weights, \(512, 128\)"):
        load_state_dict_checked(wider, diff.state_dict())


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=200))
    with pytest.raises(CheckpointError, match="tokenizer has 257 tokens but the model's vocab_size is 200"):
        model.save_pretrained(tmp_path / "ckpt", tokenizer=ByteTokenizer())


def test_a_checkpoint_that_carries_the_old_attn_backend_field_still_loads(tmp_path):
    """Checkpoints written while the backend was a ModelConfig field hold "attn_backend" in
    config.json; it is not architecture, so loading ignores it and the model runs on "auto"."""
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    out = model.save_pretrained(tmp_path / "ckpt")
    meta = json.loads((out / "config.json").read_text())
    assert "attn_backend" not in meta["model"]
    meta["model"]["attn_backend"] = "reference"
    (out / "config.json").write_text(json.dumps(meta))
    loaded = LanguageModel.from_pretrained(out)
    assert loaded.config == model.config and loaded.attn_backend == "auto"
    assert LanguageModel.from_pretrained(out, attn_backend="sdpa").attn_backend == "sdpa"
    tokens = torch.randint(0, 257, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], atol=0, rtol=0)


def _rewrite_weights(directory, convert) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    save_file({k: convert(v) for k, v in weights.items()}, directory / "model.safetensors")


def test_integer_weights_are_refused_by_name_and_half_precision_ones_load(tmp_path):
    """An int32 file would load as whole numbers (mostly 0) and generate nothing; fp16 is a precision."""
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    model.save_pretrained(tmp_path / "int32")
    _rewrite_weights(tmp_path / "int32", lambda t: t.to(torch.int32))
    with pytest.raises(CheckpointError, match=r"not floating point: embed\.weight is torch\.int32 \(the model's "
                                              r"torch\.float32\); .* and \d+ more"):
        LanguageModel.from_pretrained(tmp_path / "int32")
    model.save_pretrained(tmp_path / "fp16")
    _rewrite_weights(tmp_path / "fp16", lambda t: t.half())
    loaded = LanguageModel.from_pretrained(tmp_path / "fp16")
    assert loaded.embed.weight.dtype == torch.float32
    assert torch.equal(loaded.embed.weight, model.embed.weight.half().float())  # fp16's rounding, nothing else
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["norm.weight"] = state["norm.weight"].bool()
    with pytest.raises(CheckpointError, match=r"not floating point: norm\.weight is torch\.bool"):
        load_state_dict_checked(model, state)


def test_save_pretrained_takes_a_tokenizer_name_or_path(tmp_path):
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    out = model.save_pretrained(tmp_path / "named", tokenizer="bytes")
    assert isinstance(load_checkpoint_tokenizer(out, 257), ByteTokenizer)
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizer \(ByteTokenizer, BPETokenizer, load_tokenizer"):
        model.save_pretrained(tmp_path / "bad", tokenizer=257)
    assert not (tmp_path / "bad").exists()


def test_a_tokenizer_given_for_a_checkpoint_must_be_its_models(tmp_path):
    from diff_transformer.checkpoint import tokenizer_for_model
    from diff_transformer.data.bpe import train_bpe
    from diff_transformer.tokenizer import BPETokenizer

    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(tmp_path / "bytes", "bytes")
    train_bpe(["some text to train on " * 20], 257, show_progress=False).save(str(tmp_path / "bpe.json"))
    other = BPETokenizer(tmp_path / "bpe.json")  # the same size as the byte tokenizer, other ids
    with pytest.raises(CheckpointError, match=r"tokenizer: BPETokenizer of 257 tokens, but .*bytes holds the tokenizer "
                                              r"its model was trained with \(ByteTokenizer of 257 tokens\)"):
        tokenizer_for_model(tmp_path / "bytes", 257, other)
    assert isinstance(tokenizer_for_model(tmp_path / "bytes", 257, "bytes"), ByteTokenizer)  # its own: fine
    for vocab, fits in ((257, True), (320, True), (384, False), (8192, False)):  # 320: 257 padded to a multiple of 64
        LanguageModel(ModelConfig.from_preset("debug", vocab_size=vocab)).save_pretrained(tmp_path / f"v{vocab}")
        if fits:
            assert isinstance(tokenizer_for_model(tmp_path / f"v{vocab}", vocab, "bytes"), ByteTokenizer)
        else:
            with pytest.raises(CheckpointError, match=f"tokenizer bytes: ByteTokenizer of 257 tokens for a model of "
                                                      f"vocab_size {vocab:,}: ids 257 to {vocab - 1:,} would have "
                                                      "no text"):
                tokenizer_for_model(tmp_path / f"v{vocab}", vocab, "bytes")
