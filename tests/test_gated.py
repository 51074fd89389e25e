"""Gated attention (attention="gated" and "gated_headwise", Qiu et al. 2025) and the wide-head
Transformer: the module and every gradient against a float64 statement on every backend name, its
parameters counted by hand, its init, what it refuses, and training from the CLI."""

import math

import pytest
import torch

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.cli import main as cli_main
from diff_transformer.config import PRESETS, ConfigError
from diff_transformer.ops import BACKEND_NAMES
from test_model import naive_gated_module
from test_train import byte_dataset  # noqa: F401  (a fixture)
from checks import assert_matches_float64

GATED = ["gated", "gated_headwise"]


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("n_kv_heads", [None, 1], ids=["mha", "mqa"])
# standard attention's: "reference", "flex" (FlexAttention: no CPU backward, test_packing checks its forward), or
# SDPA under any other name
@pytest.mark.parametrize("backend", [b for b in BACKEND_NAMES if b != "flex"])
def test_gated_attention_and_every_gradient_match_the_float64_statement(kind, n_kv_heads, backend):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", attention=kind, n_kv_heads=n_kv_heads)
    model = LanguageModel(config, attn_backend=backend)
    module = model.layers[1].attn
    with torch.no_grad():  # gates spread over (0, 1), not all near sigmoid(0) = 0.5
        module.gate_proj.weight.normal_(0.0, 0.3)
    x = torch.randn(2, 19, config.d_model, requires_grad=True)
    out = module(x)
    weights = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    assert set(weights) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "o_proj.weight"}
    x64 = x.detach().double().requires_grad_()
    expected = naive_gated_module(module, x64, weights)
    gates = torch.sigmoid(x64 @ weights["gate_proj.weight"].T)
    assert gates.min() < 0.2 and gates.max() > 0.8  # the gate matters here
    assert_matches_float64(module, x, out, x64, expected, weights)


@pytest.mark.parametrize("kind", GATED)
def test_a_tap_sees_softmax_maps_and_the_output_stays_gated(kind):
    """Under a tap (the reference path with maps, what the evaluations read) the output is the gated
    output, and the effective map is the softmax map: the gate acts after it."""

    class Maps(AttentionTap):
        def __init__(self):
            self.maps = {}

        def record(self, layer_index, maps):
            self.maps[layer_index] = maps

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()
    tokens = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        plain, _ = model(tokens)
        with model.tap_attention(Maps()) as tap:
            tapped, _ = model(tokens)
        x = torch.randn(2, 17, model.config.d_model)
        module = model.layers[0].attn
        with model.tap_attention(Maps()):
            out = module(x)
    torch.testing.assert_close(tapped, plain, atol=1e-5, rtol=1e-5)
    assert (out.double() - naive_gated_module(module, x)).abs().max().item() < 1e-5
    for maps in tap.maps.values():
        assert len(maps.probs) == 1 and torch.equal(maps.combined, maps.probs[0])
        torch.testing.assert_close(maps.combined.sum(-1), torch.ones(2, model.config.n_heads, 17))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameters_counted_by_hand(preset):
    """The elementwise gate adds one d_model × d_model matrix per layer (H·d = d_model), the head-wise
    one d_model × H; the wide-head Transformer (DIFF's heads, twice the head dim) has the Transformer's."""
    std = ModelConfig.from_preset(preset, attention="standard")
    count = {kind: LanguageModel(ModelConfig.from_preset(preset, attention=kind), device="meta").num_parameters()
             for kind in ("standard", *GATED)}
    e, layers = std.d_model, std.n_layers
    assert count["gated"] - count["standard"] == layers * e * e
    assert count["gated_headwise"] - count["standard"] == layers * e * std.n_heads
    diff = ModelConfig.from_preset(preset, attention="diff")
    wide = ModelConfig.from_preset(preset, attention="standard", diff_heads=True)
    assert (wide.n_heads, wide.n_kv_heads, wide.head_dim) == (diff.n_heads, diff.n_kv_heads, 2 * diff.head_dim)
    assert LanguageModel(wide, device="meta").num_parameters() == count["standard"]


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled-init", "plain-init"])
def test_gate_proj_is_drawn_as_the_input_projections_under_both_init_recipes(kind, scaled):
    """Order q, k, v, gate (N(0, init_std)), o (N(0, init_std / sqrt(2 L)) scaled, N(0, init_std) plain),
    as the standard kind's under each recipe; no biases."""
    config = ModelConfig.from_preset("debug", attention=kind, scale_residual_init=scaled)
    model = LanguageModel(config)
    std = config.init_std
    out_std = std / math.sqrt(2 * config.n_layers) if scaled else std
    a = model.layers[0].attn
    a.init_weights(std, out_std, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    for tensor, scale in ((a.q_proj.weight, std), (a.k_proj.weight, std), (a.v_proj.weight, std),
                          (a.gate_proj.weight, std), (a.o_proj.weight, out_std)):
        torch.testing.assert_close(tensor, torch.empty_like(tensor).normal_(0.0, scale, generator=g), atol=0, rtol=0)
    width = config.n_heads * (config.head_dim if kind == "gated" else 1)
    assert a.gate_proj.weight.shape == (width, config.d_model) and a.gate_proj.bias is None
    assert a.head_norm is None and not any(name.endswith("bias") for name, _ in model.named_parameters())


@pytest.mark.parametrize("kind", GATED)
def test_refusals_name_the_problem(kind, tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"head_norm: attention='{kind}' gates each head's output"):
        ModelConfig.from_preset("debug", attention=kind, head_norm=True)
    with pytest.raises(ConfigError, match="lambda_init only applies"):
        ModelConfig.from_preset("debug", attention=kind, lambda_init=0.5)
    LanguageModel(ModelConfig.from_preset("debug", attention=kind)).save_pretrained(tmp_path / "model")
    # no transformers class computes it: export-hf writes remote code (loaded in tests/test_export_remote.py)
    assert cli_main(["export-hf", str(tmp_path / "model"), str(tmp_path / "hf")]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out


# one fast, the others (the same path, another config entry) in the slow tier
ENTRIES = ["gated", *(pytest.param(name, marks=pytest.mark.slow) for name in ("gated_headwise", "standard-wide"))]


@pytest.mark.parametrize("name", ENTRIES)
def test_the_tiny_configs_new_models_train_save_load_and_generate_from_the_cli(name, byte_dataset,  # noqa: F811
                                                                               tmp_path, capsys):
    """`train --config tiny --model NAME` (shrunk to the debug size on byte-level data), then the
    checkpoint loads with its kind and generates."""
    out = tmp_path / "run"
    overrides = ["model.preset=debug", "model.d_model=64", "model.n_layers=2", "model.vocab_size=257",
                 "model.max_seq_len=32", f"data.dataset={byte_dataset}", "data.seq_len=32", "data.batch_size=4",
                 "data.eval_sequences=4", "run.steps=4", "run.eval_every=2", "run.log_every=2",
                 f"run.out_dir={out}", "run.tensorboard=false", "run.progress=false"]
    assert cli_main(["train", "--config", "tiny", "--model", name, *[f"--set={o}" for o in overrides]]) == 0
    model = LanguageModel.from_pretrained(out / "checkpoint")
    kind = "standard" if name == "standard-wide" else name
    assert model.config.attention == kind
    if name == "standard-wide":
        assert (model.config.n_heads, model.config.head_dim) == (2, 32)
    capsys.readouterr()
    assert cli_main(["generate", str(out / "checkpoint"), "--prompt", "The", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
