"""``export-hf --layout motif``: a Motif directory imported and exported again holds the same tensors
under the same names (bf16 kept), config.json reads back to the same model, shards with their index;
what Motif's layout cannot express is refused by name, writing nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from motif_fixtures import make_tiny_motif_dir
from safetensors import safe_open

from diff_transformer.cli import main as cli_main
from diff_transformer.config import ModelConfig
from diff_transformer.interop.hf import import_hf, load_hf, model_config_from_hf
from diff_transformer.interop.mapping import HFConversionError
from diff_transformer.interop.motif_export import save_motif
from diff_transformer.model import LanguageModel

pytest.importorskip("transformers")


def tensors_of(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded Motif directory, by name, as stored."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(directory / shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    assert set(out) == set(index)
    return out


@pytest.mark.parametrize("layout, gqa, tie", [("2.6b", False, False), ("2.6b", True, True), ("12.7b", True, False)])
def test_a_motif_directory_round_trips_tensor_for_tensor_in_bf16(layout, gqa, tie, tmp_path, capsys):
    source = make_tiny_motif_dir(tmp_path / "release", layout, gqa=gqa, tie=tie, dtype=torch.bfloat16)
    import_hf(source, tmp_path / "ckpt", dtype="bfloat16")
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0  # Motif's layout by default
    assert "Motif's layout" in capsys.readouterr().out
    ours, theirs = tensors_of(tmp_path / "out"), tensors_of(source)
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name
    released = json.loads((source / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert model_config_from_hf(written, tmp_path / "out", ours) == model_config_from_hf(released, source, theirs)
    for field in ("model_type", "architectures", "num_attention_heads", "num_key_value_heads", "hidden_act",
                  "rms_norm_eps", "attn_rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id", "num_noise_heads", "head_dim"):
        assert written.get(field) == released.get(field), field
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def motif_like(**overrides) -> LanguageModel:
    """A model trained here with Motif's arithmetic (as a fine-tuned import is): fp32, random weights."""
    torch.manual_seed(0)
    fields = dict(attention="gda", n_heads=4, gda_ratio=2, n_kv_heads=2, ffn_activation="polynorm",
                  lambda_init_depth_offset=-1, head_norm_eps=1e-5, norm_eps=1e-6, init_std=0.1)
    model = LanguageModel(ModelConfig.from_preset("debug", **{**fields, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lambda_" in name or "polynorm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def test_a_model_of_motifs_arithmetic_leaves_in_shards_and_comes_back_the_same(tmp_path):
    model = motif_like(attention_bias=True, attention_out_bias=True)
    save_motif(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    back, _ = load_hf(tmp_path / "out")
    # GDA's head_dim is written (Motif's code requires it beside num_noise_heads): read back as attn_head_dim
    assert back.config.head_dim == model.config.head_dim
    assert dataclasses.replace(back.config, attn_head_dim=None) == model.config
    tokens = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(back(tokens)[0], model(tokens)[0])


@pytest.mark.parametrize("overrides, message", [
    (dict(ffn_activation="silu"), "ffn_activation='silu' .Motif's MLP is PolyNorm"),
    (dict(lambda_init_depth_offset=0), "λ_init on another schedule"),
    (dict(mlp_bias=True), "mlp_bias without attention_out_bias"),
])
def test_what_motifs_layout_cannot_express_is_refused_by_name(overrides, message, tmp_path):
    with pytest.raises(HFConversionError, match=message):
        save_motif(motif_like(**overrides), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_layout_hf_writes_a_motif_model_as_remote_code(tmp_path):
    motif_like().save_pretrained(tmp_path / "ckpt")
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--layout", "hf"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "diff_transformer"
