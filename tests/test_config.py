"""ModelConfig: validation, derived fields, presets and the parameter matching of DIFF vs Transformer."""

import pytest

from diff_transformer import ConfigError, LanguageModel, ModelConfig
from diff_transformer.config import PAPER_SIZES, PRESETS, lambda_init_schedule


def count(config: ModelConfig, **kw) -> int:
    return LanguageModel(config, device="meta").num_parameters(**kw)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(d_model=100, n_heads=3), r"d_model=100 must be divisible by 2 \* n_heads"),
        (dict(d_model=100, n_heads=3, attention="standard"), "d_model=100 must be divisible by n_heads = 3"),
        (dict(n_heads=4, n_kv_heads=3, d_model=128), "n_kv_heads=3 must be a positive divisor of n_heads=4"),
        (dict(d_model=36, n_heads=2), "head_dim=9 .* must be even for RoPE"),
        (dict(attention="linear"),
         "attention must be one of standard, diff, diff_v2, diff_symmetric, gated, gated_headwise, gda, mta, xsa, "
         "got 'linear'"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(attention="diff_v2", head_norm=True, n_heads=2, d_model=64), "head_norm: DIFF V2 has no per-head norm"),
        (dict(attention="standard", lambda_init=0.8, n_heads=2, d_model=64), "lambda_init only applies"),
        (dict(attention="diff_symmetric", n_heads=4, n_kv_heads=2, d_model=128),
         "n_kv_heads=2 with attention='diff_symmetric': its keys are its queries"),
        (dict(value_factor=3), "value_factor must be 1 or 2 with attention='diff'"),
        (dict(value_factor=True), r"value_factor must be 1 or 2 .* got True"),
        (dict(attention="standard", value_factor=2, n_heads=2, d_model=64),
         "value_factor must be 1 with attention='standard'"),
        (dict(attention="diff_v2", value_factor=2, n_heads=2, d_model=64),
         "value_factor must be 1 with attention='diff_v2'"),
        (dict(attention="diff_symmetric", value_factor=1), "value_factor must be 2 with attention='diff_symmetric'"),
        (dict(d_model=100, n_heads=3, value_factor=1), "d_model=100 must be divisible by n_heads = 3"),
    ],
)
def test_invalid_config_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields)


def test_unknown_field_and_preset_are_named():
    with pytest.raises(ConfigError, match="unknown ModelConfig field.*n_head\\b"):
        ModelConfig.from_dict({"n_head": 4})
    with pytest.raises(ConfigError, match="unknown preset '7b'"):
        ModelConfig.from_preset("7b")


def test_derived_fields():
    c = ModelConfig(d_model=2048, n_heads=8, attention="diff")
    assert c.head_dim == 128 and c.n_kv_heads == 8 and c.head_norm is True
    assert c.ffn_hidden == 5504  # 8/3 * 2048 = 5461.3, rounded up to a multiple of 64
    assert ModelConfig(d_model=3072, n_heads=12).ffn_hidden == 8192  # exactly 8/3 * 3072
    std = ModelConfig(d_model=2048, n_heads=16, attention="standard")
    assert std.head_dim == 128 and std.head_norm is False


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2", "diff_symmetric"])
def test_value_factor_left_unset_keeps_every_preset_and_saved_config(name, kind):
    """value_factor's default is each kind's own value width (2d for DIFF heads, d otherwise): every
    preset keeps its head width, and a config.json written before the field existed reads as before."""
    config = ModelConfig.from_preset(name, attention=kind)
    diff_heads = kind in ("diff", "diff_symmetric")
    heads = PRESETS[name]["n_heads"] * (1 if diff_heads else 2)
    assert config.value_factor == (2 if diff_heads else 1)
    assert (config.n_heads, config.head_dim) == (heads, PRESETS[name]["d_model"] // (2 * PRESETS[name]["n_heads"]))
    saved_before = {k: v for k, v in config.to_dict().items() if k != "value_factor"}
    assert ModelConfig.from_dict(saved_before) == config


def test_diff_with_values_of_width_d_is_a_transformer_with_second_maps_and_lambda():
    """value_factor=1: as many DIFF heads as the Transformer has heads, of its width; beyond it, per
    layer, the second query and key maps (E × H·d and E × Hkv·d) and the four λ vectors, counted by hand."""
    std = ModelConfig.from_preset("tiny", attention="standard", n_kv_heads=2)
    diff = ModelConfig.from_preset("tiny", attention="diff", n_heads=6, n_kv_heads=2, value_factor=1, head_norm=False)
    assert (diff.n_heads, diff.head_dim) == (std.n_heads, std.head_dim) == (6, 32)
    e, d = 192, 32
    assert count(diff) - count(std) == 4 * (e * 6 * d + e * 2 * d + 4 * d)


def test_lambda_init_schedule_is_the_papers():
    # λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) with l the 1-based layer
    assert lambda_init_schedule(0) == pytest.approx(0.2)
    assert lambda_init_schedule(1) == pytest.approx(0.8 - 0.6 * 0.7408182206817179)
    assert lambda_init_schedule(40) == pytest.approx(0.8, abs=1e-5)
    assert ModelConfig(lambda_init=0.5).lambda_init_for(7) == 0.5


def test_round_trip_through_dict():
    c = ModelConfig.from_preset("tiny", attention="standard", n_kv_heads=2)
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("name", list(PAPER_SIZES))
def test_paper_presets_match_their_nominal_size(name):
    """The paper's sizes count one vocab x d_model table beside the blocks (no separate LM head).

    Table 10 sizes agree within 2%; Table 9's "3B" is looser (3.17B blocks + 0.31B embedding).
    """
    config = ModelConfig.from_preset(name, attention="diff")
    counted = count(config, exclude_embeddings=True) + config.vocab_size * config.d_model
    tolerance = 0.16 if name == "3b" else 0.02
    assert abs(counted / PAPER_SIZES[name] - 1) < tolerance, f"{name}: {counted:,}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_diff_and_matched_transformer_differ_by_lambda_and_head_norm_only(name):
    diff = ModelConfig.from_preset(name, attention="diff")
    std = ModelConfig.from_preset(name, attention="standard")
    assert std.n_heads == 2 * diff.n_heads and std.head_dim == diff.head_dim
    # per layer: four λ vectors (4d) and the head-norm weight (2d)
    assert count(diff) - count(std) == 6 * diff.head_dim * diff.n_layers


def test_gqa_preset_doubles_kv_heads_for_the_baseline():
    diff = ModelConfig.from_preset("small", attention="diff", n_kv_heads=2)
    std = ModelConfig.from_preset("small", attention="standard", n_kv_heads=4)
    assert count(diff) - count(std) == 6 * diff.head_dim * diff.n_layers


def test_table6_ablation_switches():
    base = ModelConfig.from_preset("1.4b", attention="diff")
    no_norm = ModelConfig.from_preset("1.4b", attention="diff", head_norm=False)
    assert count(base) - count(no_norm) == 2 * base.head_dim * base.n_layers
    assert ModelConfig.from_preset("1.4b", lambda_init=0.8).lambda_init_for(0) == 0.8
    std_norm = ModelConfig.from_preset("1.4b", attention="standard", head_norm=True)
    assert count(std_norm) - count(ModelConfig.from_preset("1.4b", attention="standard")) == 128 * 24
    half_heads = ModelConfig.from_preset("1.4b", attention="standard", n_heads=8)
    assert half_heads.n_heads == 8 and half_heads.head_dim == 256


def test_diff_v2_shape():
    v2 = ModelConfig.from_preset("tiny", attention="diff_v2")
    std = ModelConfig.from_preset("tiny", attention="standard")
    assert v2.n_heads == std.n_heads and v2.head_dim == std.head_dim
    # extra per layer: the second half of the query heads (E x H·d) and W_λ (E x H)
    e, h, d = v2.d_model, v2.n_heads, v2.head_dim
    assert count(v2) - count(std) == v2.n_layers * (e * h * d + e * h)


@pytest.mark.parametrize("name", list(PRESETS))
def test_symmetric_diff_has_one_d_model_square_matrix_per_layer_fewer(name):
    """diff_symmetric: DIFF's heads and widths, one qk_proj (E × 2H·d = E × E) in the place of
    q_proj and k_proj (E × E each, MHA): DIFF's count minus E² per layer, counted by hand."""
    diff = ModelConfig.from_preset(name, attention="diff")
    sym = ModelConfig.from_preset(name, attention="diff_symmetric")
    assert (sym.n_heads, sym.head_dim, sym.head_norm) == (diff.n_heads, diff.head_dim, True)
    e, layers, v, f = diff.d_model, diff.n_layers, diff.vocab_size, diff.ffn_hidden
    d = diff.head_dim
    per_layer = (e * e + e * e + e * e  # qk_proj, v_proj, o_proj
                 + 4 * d + 2 * d  # λ vectors, head-norm weight
                 + 3 * e * f + 2 * e)  # SwiGLU, the two block norms
    assert count(sym) == layers * per_layer + 2 * v * e + e  # + embedding, LM head, final norm
    assert count(diff) - count(sym) == layers * e * e
