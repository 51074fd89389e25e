"""Exclusive self-attention (attention="xsa", Zhai 2026): the module and every gradient against a float64
statement on every backend name, with and without its gate; the correction by hand; the effective map a
tap sees; KV-cache, padded and compiled decoding against the full forward; packed documents; parameters,
init, config and what it refuses."""

import math

import pytest
import torch

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.attention import exclude_own_value
from diff_transformer.checkpoint import CheckpointError
from diff_transformer.cli import main as cli_main
from diff_transformer.config import PRESETS, ConfigError
from diff_transformer.model import document_ids
from diff_transformer.ops import BACKEND_NAMES
from diff_transformer.train import train
from test_model import causal_softmax, rope_complex
from test_train import byte_dataset, debug_config  # noqa: F401  (byte_dataset: a fixture)
from checks import assert_matches_float64, compiled_decoding_error


def naive_xsa_module(m, x, w=None):
    """The paper's z_i = y_i − g_h (y_iᵀ v_i / ‖v_i‖²) v_i in float64, one head at a time, on softmax
    attention's y (head h reads key/value head h // (H / Hkv)); g_h = sigmoid(β_h) with the gate, else 1.
    ``w``: float64 leaves by parameter name (for the gradients)."""
    cfg, d = m.config, m.head_dim
    w = w or {name: p.double() for name, p in m.named_parameters()}
    b, t, _ = x.shape
    x = x.double()
    q = rope_complex((x @ w["q_proj.weight"].T).view(b, t, -1, d), cfg.rope_theta)
    k = rope_complex((x @ w["k_proj.weight"].T).view(b, t, -1, d), cfg.rope_theta)
    v = (x @ w["v_proj.weight"].T).view(b, t, -1, d)
    heads = []
    for h in range(cfg.n_heads):
        g = h // (cfg.n_heads // cfg.n_kv_heads)
        y = causal_softmax(q[:, :, h] @ k[:, :, g].transpose(-1, -2) / math.sqrt(d)) @ v[:, :, g]  # (B, T, d)
        own = v[:, :, g]
        gate = torch.sigmoid(w["xsa_gate"][h]) if "xsa_gate" in w else 1.0
        heads.append(y - gate * (y * own).sum(-1, keepdim=True) / (own * own).sum(-1, keepdim=True) * own)
    return torch.cat(heads, -1) @ w["o_proj.weight"].T


def xsa_model(*, gate=False, backend="auto", seed=0, **fields):
    """A debug-size XSA model; with the gate, β spread so that the gates differ per head."""
    torch.manual_seed(seed)
    model = LanguageModel(ModelConfig.from_preset("debug", attention="xsa", xsa_gate=gate, **fields),
                          attn_backend=backend)
    if gate:
        with torch.no_grad():
            for layer in model.layers:
                layer.attn.xsa_gate.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("gate", [False, True], ids=["xsa", "gated"])
@pytest.mark.parametrize("n_kv_heads", [None, 1], ids=["mha", "mqa"])
# standard attention's: "reference", or SDPA under every other name but "flex" (no CPU backward; tested below)
@pytest.mark.parametrize("backend", [b for b in BACKEND_NAMES if b != "flex"])
def test_module_and_every_gradient_match_the_float64_statement(gate, n_kv_heads, backend):
    model = xsa_model(gate=gate, n_kv_heads=n_kv_heads, backend=backend)
    module = model.layers[1].attn
    x = torch.randn(2, 19, model.config.d_model, requires_grad=True)
    out = module(x)
    weights = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    assert ("xsa_gate" in weights) == gate
    x64 = x.detach().double().requires_grad_()
    expected = naive_xsa_module(module, x64, weights)
    assert_matches_float64(module, x, out, x64, expected, weights)


def test_the_correction_by_hand():
    """Without a gate the output is orthogonal to the own value and differs from y by a multiple of it;
    a gate of 0 leaves y; one value head serving two query heads; a zero value changes nothing."""
    g = torch.Generator().manual_seed(0)
    y, own = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    z, coef = exclude_own_value(y, own, None)
    v = own.repeat_interleave(2, dim=1)
    assert (z * v).sum(-1).abs().max().item() < 1e-5
    by_hand = (y.double() * v.double()).sum(-1, keepdim=True) / (v.double() ** 2).sum(-1, keepdim=True)
    torch.testing.assert_close(coef.double(), by_hand, atol=1e-6, rtol=1e-5)  # fp32 against float64
    torch.testing.assert_close(z.double(), y.double() - by_hand * v.double(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(exclude_own_value(y, own, torch.zeros(4))[0], y)
    half = exclude_own_value(y, own, torch.full((4,), 0.5))[0]
    torch.testing.assert_close(half, (y + z) / 2)
    torch.testing.assert_close(exclude_own_value(y, torch.zeros_like(own), None)[0], y)


def test_a_tap_sees_the_softmax_map_less_the_own_key():
    """Under a tap the output is the model's; maps.probs is the softmax map, and maps.combined that map
    with c_i taken off each query's own key: the output heads are exactly maps.combined · V."""

    class Maps(AttentionTap):
        def __init__(self):
            self.maps = {}

        def record(self, layer_index, maps):
            self.maps[layer_index] = maps

    model = xsa_model(gate=True, n_kv_heads=1).eval()
    tokens = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        plain, _ = model(tokens)
        with model.tap_attention(Maps()):
            tapped, _ = model(tokens)
        torch.testing.assert_close(tapped, plain, atol=1e-5, rtol=1e-5)
        module = model.layers[1].attn
        x = torch.randn(2, 17, model.config.d_model)
        with model.tap_attention(Maps()) as one:
            out = module(x)
    maps = one.maps[1]
    off_own = ~torch.eye(17, dtype=torch.bool)
    assert torch.equal((maps.combined - maps.probs[0])[..., off_own], torch.zeros_like(maps.combined[..., off_own]))
    assert (maps.combined - maps.probs[0]).abs().max() > 1e-2
    v = (x.double() @ module.v_proj.weight.double().T).view(2, 17, 1, 16).transpose(1, 2)  # one value head
    heads = maps.combined.double() @ v  # (B, H, T, d)
    expected = heads.transpose(1, 2).reshape(2, 17, -1) @ module.o_proj.weight.double().T
    assert (out.double() - expected).abs().max().item() < 1e-5
    assert (out.double() - naive_xsa_module(module, x)).abs().max().item() < 1e-5


@pytest.mark.slow  # ten decodes token by token (34 s in all)
@pytest.mark.parametrize("gate", [False, True], ids=["xsa", "gated"])
@pytest.mark.parametrize("backend", ["auto", "reference", "math"])
@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_cached_decoding_gives_the_full_forward_logits(gate, backend, static):
    """The own value of a new token is its stored value: the cache's last rows, or the static cache's
    slots at the new positions."""
    model = xsa_model(gate=gate, backend=backend).eval()
    tokens = torch.randint(0, 512, (2, 23))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 32, static=static)
        pieces = [model(tokens[:, :7], cache=cache)[0], model(tokens[:, 7:12], cache=cache)[0]]
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(12, 23)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_left_padding_and_packed_documents_give_each_sequence_its_own_outputs():
    model = xsa_model(gate=True).eval()
    rows = [torch.randint(0, 512, (n,)) for n in (9, 4)]
    steps = torch.randint(0, 512, (2, 5))
    prompt, real = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.bool)
    for i, row in enumerate(rows):
        prompt[i, 9 - len(row):], real[i, 9 - len(row):] = row, True
    with torch.no_grad():
        cache = model.new_cache(2, 20, static=True)
        got = [model(prompt, cache=cache, padding_mask=real)[0]]
        got = torch.cat(got + [model(steps[:, i : i + 1], cache=cache)[0] for i in range(5)], 1)
        for i, row in enumerate(rows):
            alone = model(torch.cat([row, steps[i]])[None])[0][0]
            torch.testing.assert_close(got[i, 9 - len(row):], alone, atol=1e-5, rtol=1e-5)
        documents = [torch.randint(1, 512, (n,)) for n in (5, 9, 1, 3, 6)]
        for document in documents[1:]:
            document[0] = 0
        tokens = torch.cat(documents)[None]
        for backend in ("auto", "reference"):
            model.set_attention_backend(backend)
            logits = model(tokens, document_ids=document_ids(tokens, 0))[0][0]
            start = 0
            for document in documents:
                alone = model(document[None])[0][0]
                assert (logits[start:start + len(document)] - alone).abs().max().item() < 2e-5
                start += len(document)


@pytest.mark.slow  # torch.compile traces the decoding step
def test_compiled_decoding_with_a_static_cache_compiles_once():
    assert compiled_decoding_error(xsa_model(gate=True).eval()) < 1e-5


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameters_counted_by_hand(preset):
    """XSA has the matched Transformer's parameters (the same heads); its gate adds one per head and layer."""
    std = ModelConfig.from_preset(preset, attention="standard")
    count = {gate: LanguageModel(ModelConfig.from_preset(preset, attention="xsa", xsa_gate=gate),
                                 device="meta").num_parameters() for gate in (False, True)}
    assert count[False] == LanguageModel(std, device="meta").num_parameters()
    assert count[True] - count[False] == std.n_layers * std.n_heads
    assert ModelConfig.from_preset(preset, attention="xsa").n_heads == std.n_heads


def test_the_gate_is_an_fp32_vector_at_zero_and_the_rest_is_drawn_as_the_transformer():
    config = ModelConfig.from_preset("debug", attention="xsa", xsa_gate=True)
    a = LanguageModel(config).layers[0].attn
    a.init_weights(0.02, 0.005, torch.Generator().manual_seed(5))
    assert a.xsa_gate.dtype == torch.float32 and torch.equal(a.xsa_gate, torch.zeros(4))
    standard = LanguageModel(ModelConfig.from_preset("debug", attention="standard")).layers[0].attn
    standard.init_weights(0.02, 0.005, torch.Generator().manual_seed(5))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(a, name).weight, getattr(standard, name).weight)
    plain = LanguageModel(ModelConfig.from_preset("debug", attention="xsa")).layers[0].attn
    assert a.head_norm is None and plain.xsa_gate is None


@pytest.mark.parametrize("fields, message", [
    (dict(attention="standard", xsa_gate=True), "xsa_gate only applies to attention='xsa', not 'standard'"),
    (dict(attention="xsa", xsa_gate="yes"), "xsa_gate must be true or false, got 'yes'"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_preset("debug", **fields)


def test_checkpoints_round_trip_and_export_hf_writes_it_as_remote_code(tmp_path, capsys):
    model = xsa_model(gate=True)
    out = model.save_pretrained(tmp_path / "model")
    loaded = LanguageModel.from_pretrained(out)
    assert loaded.config == model.config and loaded.config.xsa_gate
    tokens = torch.randint(0, 512, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], atol=0, rtol=0)
    assert cli_main(["export-hf", str(out), str(tmp_path / "hf")]) == 0  # loaded in tests/test_export_remote.py
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert (tmp_path / "hf" / "modeling_diff_transformer.py").is_file()


def test_it_trains_and_a_resume_that_drops_the_gate_is_refused(byte_dataset, tmp_path):  # noqa: F811
    """The gate (a vector: no weight decay) trains; turning it off for the resume is refused by name."""
    train(debug_config(byte_dataset, tmp_path, {"xsa": {"attention": "xsa", "xsa_gate": True}},
                       run={"stop_at_step": 2}))
    with pytest.raises(CheckpointError, match=r"model\.xsa_gate: True -> False"):
        train(debug_config(byte_dataset, tmp_path, {"xsa": {"attention": "xsa"}}), resume=True)
    gates = LanguageModel.from_pretrained(tmp_path / "checkpoint").layers[0].attn.xsa_gate
    assert gates.abs().max() > 0  # moved from 0
