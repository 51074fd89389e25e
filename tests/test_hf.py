"""Hugging Face transformers interop: export -> from_pretrained parity, export -> import, greedy
generation, tokenizers, and the clear refusals for what transformers cannot express."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diff_transformer.checkpoint import CheckpointError
from diff_transformer.cli import main as cli_main
from diff_transformer.config import ModelConfig
from diff_transformer.interop.hf import HFConversionError, import_hf, load_hf, save_hf
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import EOS_TOKEN, BPETokenizer, ByteTokenizer

transformers = pytest.importorskip("transformers")

# (attention, n_heads, n_kv_heads, tie_embeddings) on the "debug" size (d_model 64, 2 layers).
# GQA cases have two KV groups of two heads each, so the value regrouping is not the identity.
CASES = {
    "diff-mha": ("diff", 2, 2, False),
    "diff-gqa": ("diff", 4, 2, True),
    "standard-mha": ("standard", 4, 4, False),
    "standard-gqa": ("standard", 8, 4, True),
}
LOGITS_TOL = 1e-4


def random_model(attention: str, n_heads: int, n_kv_heads: int, tie: bool) -> LanguageModel:
    """A debug-size model whose every weight matters: larger init than training uses (so attention
    is sharp and a wrong head mapping shows), random norm weights (so the head-norm fold is
    tested) and random λ vectors."""
    config = ModelConfig.from_preset(
        "debug", attention=attention, n_heads=n_heads, n_kv_heads=n_kv_heads, tie_embeddings=tie, init_std=0.1
    )
    model = LanguageModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "lambda_" in name:
                param.normal_(0.0, 0.3)
    return model.eval()


def hf_load(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("case", CASES)
def test_exported_logits_match_transformers(case, tmp_path):
    model = random_model(*CASES[case])
    save_hf(model, tmp_path / "hf", ByteTokenizer())
    hf_model, info = hf_load(tmp_path / "hf")
    expected = "DiffLlamaForCausalLM" if model.config.attention == "diff" else "LlamaForCausalLM"
    assert type(hf_model).__name__ == expected
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf_model.dtype == torch.float32
    tokens = torch.randint(0, model.config.vocab_size, (2, 48))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = hf_model(tokens).logits
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("case", CASES)
def test_export_then_import_is_exact(case, tmp_path):
    model = random_model(*CASES[case])
    model.save_pretrained(tmp_path / "ours", ByteTokenizer())
    assert cli_main(["export-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    assert cli_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = LanguageModel.from_pretrained(tmp_path / "back").eval()
    assert back.config == model.config
    original, returned = model.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for name, tensor in original.items():
        if name.endswith("attn.head_norm.weight"):  # folded into o_proj: comes back as ones
            assert torch.equal(returned[name], torch.ones_like(tensor))
        elif name.endswith("attn.o_proj.weight") and model.config.attention == "diff":
            norm = original[name.replace("o_proj", "head_norm")]
            assert torch.equal(returned[name], tensor * norm.repeat(model.config.n_heads)[None, :])
        else:
            assert torch.equal(returned[name], tensor), name  # permutations are exact
    tokens = torch.randint(0, model.config.vocab_size, (2, 48))
    with torch.no_grad():
        assert (model(tokens)[0] - back(tokens)[0]).abs().max().item() < 1e-5
    _, tokenizer = load_hf(tmp_path / "hf")
    assert isinstance(tokenizer, ByteTokenizer)  # the exported byte-level JSON is recognised


@pytest.mark.parametrize("case", ["diff-gqa", "standard-mha"])
def test_greedy_generation_matches_transformers(case, tmp_path):
    model = random_model(*CASES[case])
    save_hf(model, tmp_path / "hf", ByteTokenizer())
    hf_model, _ = hf_load(tmp_path / "hf")
    prompt = list(b"The sun rises in the")
    eos = ByteTokenizer.eos_id
    ours = model.generate([prompt], 20, temperature=0, stop_tokens=[eos])[0]
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :]
    theirs = theirs.tolist()
    assert ours == (theirs[: theirs.index(eos)] if eos in theirs else theirs)
    assert len(theirs) == 20  # a stop at EOS would shorten the comparison; this seed has none


def test_exported_byte_tokenizer_is_the_byte_tokenizer(tmp_path):
    model = random_model(*CASES["diff-mha"])
    save_hf(model, tmp_path / "hf", ByteTokenizer())
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Differential attention, naïve café — 日本語 🎉\n\ttabs"
    assert hf_tok(text)["input_ids"] == ByteTokenizer().encode(text)  # no BOS added
    assert hf_tok.eos_token == hf_tok.bos_token == hf_tok.pad_token == EOS_TOKEN
    assert hf_tok.eos_token_id == ByteTokenizer.eos_id
    assert hf_tok.model_max_length == model.config.max_seq_len
    assert hf_tok.decode(ByteTokenizer().encode(text)) == text


def _train_bpe(path) -> BPETokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the differential transformer cancels attention noise"] * 20, trainer)
    tok.save(str(path))
    return BPETokenizer(path)


def test_exported_bpe_tokenizer_encodes_like_ours(tmp_path):
    tokenizer = _train_bpe(tmp_path / "bpe.json")
    model = random_model(*CASES["standard-mha"])
    model.save_pretrained(tmp_path / "ours", tokenizer)
    assert cli_main(["export-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the transformer cancels noise, differentially"
    assert hf_tok(text)["input_ids"] == tokenizer.encode(text)
    assert hf_tok.eos_token_id == tokenizer.eos_id
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == config["pad_token_id"] == tokenizer.eos_id
    _, imported = load_hf(tmp_path / "hf")
    assert isinstance(imported, BPETokenizer) and imported.encode(text) == tokenizer.encode(text)


def test_import_reads_sharded_safetensors(tmp_path):
    model = random_model(*CASES["diff-mha"])
    save_hf(model, tmp_path / "hf", None)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / "hf" / shard), metadata={"format": "pt"})
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    back, tokenizer = load_hf(tmp_path / "hf")
    assert tokenizer is None
    tokens = torch.randint(0, model.config.vocab_size, (1, 32))
    with torch.no_grad():
        assert (model(tokens)[0] - back(tokens)[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attention="diff_v2"), "DIFF V2 has no Hugging Face"),
        (dict(attention="diff_symmetric"),
         r"symmetric DIFF \(attention='diff_symmetric', keys = queries\) has no transformers equivalent"),
        (dict(attention="diff", lambda_init=0.8), "constant lambda_init=0.8"),
        (dict(attention="diff", head_norm=False), "head_norm=False"),
        (dict(attention="diff", value_factor=1), r"value_factor=1, a Transformer converted"),
        (dict(attention="diff", norm_eps=1e-6), "norm_eps is 1e-06"),
        (dict(attention="standard", head_norm=True), "no Llama equivalent"),
    ],
)
def test_export_refuses_what_transformers_cannot_express(overrides, message, tmp_path):
    attention = overrides.pop("attention")
    model = LanguageModel(ModelConfig.from_preset("debug", attention=attention, **overrides))
    with pytest.raises(HFConversionError, match=message):
        save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("attention", ["diff_v2", "diff_symmetric"])
def test_what_transformers_lacks_leaves_as_remote_code(attention, tmp_path, capsys):
    """save_hf refuses it (above); export-hf writes it as remote code (tests/test_export_remote.py loads it)."""
    LanguageModel(ModelConfig.from_preset("debug", attention=attention)).save_pretrained(tmp_path / "model")
    assert cli_main(["export-hf", str(tmp_path / "model"), str(tmp_path / "hf")]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "diff_transformer" and "AutoModelForCausalLM" in config["auto_map"]


def _exported(tmp_path, tokenizer=None):
    save_hf(random_model(*CASES["diff-mha"]), tmp_path / "hf", tokenizer)
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE scaling 'yarn'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "RoPE scaling 'linear' needs factor"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "attention_factor": 1.5}},
         "RoPE field.s. attention_factor of kind 'linear' are not read"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None}, "even num_attention_heads"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": 24}, "heads must fill"),
    ],
)
def test_import_refuses_unsupported_configs(edit, message, tmp_path):
    directory = _exported(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match=message):
        import_hf(directory, tmp_path / "out")


@pytest.mark.parametrize("attention, fields", [
    ("standard", dict(rope_scaling=dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_seq_len=32), rope_theta=500.0)),
    ("standard", dict(rope_scaling=dict(kind="linear", factor=4.0))),
    ("diff", dict(rope_scaling=dict(kind="linear", factor=2.0))),
    ("diff", dict(norm_eps=1e-6, head_norm_eps=1e-6)),  # DiffLlama's one rms_norm_eps, here not 1e-5
    ("diff", dict(attn_head_dim=24)),  # heads wider than d_model / (2H): DiffLlama's head_dim
])
def test_scaled_rope_eps_and_head_dim_match_transformers_both_ways(attention, fields, tmp_path):
    """RoPE scaling (Llama 3's and linear), a DiffLlama rms_norm_eps other than 1e-5 and an explicit
    head_dim, computed by transformers from the exported files: the logits agree, and import gives
    the model back."""
    model = random_model(attention, 2 if attention == "diff" else 4, 2 if attention == "diff" else 4, False)
    config = ModelConfig.from_dict({**model.config.to_dict(), **fields})
    ours = LanguageModel(config).eval()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" not in name else 0.1) + ("norm" in name))
    save_hf(ours, tmp_path / "hf", ByteTokenizer())
    hf_model, info = hf_load(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, config.vocab_size, (2, 96))  # beyond the llama3 case's 32 original positions
    with torch.no_grad():
        logits = ours(tokens)[0]
        assert (logits - hf_model(tokens).logits).abs().max().item() < LOGITS_TOL * max(1.0, logits.abs().max())
        back, _ = load_hf(tmp_path / "hf")
        assert back.config == config
        assert (back.eval()(tokens)[0] - logits).abs().max().item() < 1e-5


def test_import_names_weights_that_do_not_fit(tmp_path):
    directory = _exported(tmp_path)
    weights = load_file(str(directory / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight.*"
                                              r"not understood: model\.layers\.0\.self_attn\.q_proj\.bias"):
        import_hf(directory, tmp_path / "out")


def test_import_names_weights_mis_shaped_for_the_config(tmp_path):
    directory = _exported(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["num_key_value_heads"] = 2  # weights were written for 4 (two DIFF KV groups)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"shape mismatch: layers\.0\.attn\.k_proj\.weight: \(64, 64\)"):
        import_hf(directory, tmp_path / "out")


def test_import_needs_endoftext_or_no_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    directory = _exported(tmp_path)
    Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(str(directory / "tokenizer.json"))
    with pytest.raises(HFConversionError, match="--no-tokenizer"):
        import_hf(directory, tmp_path / "out")
    assert cli_main(["import-hf", str(directory), str(tmp_path / "out"), "--no-tokenizer"]) == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    LanguageModel.from_pretrained(tmp_path / "out")
