"""Grouped differential attention (attention="gda"): at gda_ratio 1 it is DIFF with the same weights,
bit for bit; in general it is pinned by a float64 statement written here, head by head, from the
arithmetic of Motif's published code (vLLM's GroupedDifferentialAttention backend); every backend
matches the reference op; KV-cache and compiled decoding equal the full forward; checkpoints and the
tap-based evaluations work."""

from __future__ import annotations

import math

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig, MultiheadDiffAttention
from diff_transformer.attention import AttentionTap, GroupedDiffAttention
from diff_transformer.config import ConfigError
from diff_transformer.ops import gda_attention, reference_gda_attention
from checks import compiled_decoding_error

TOL = 1e-5  # fp32 against float64 / the fp32 reference, absolute (relative to the largest entry for gradients)
# the model's backends: "auto" ("math" on the CPU) in the fast tier, the others in the slow one
MODEL_BACKENDS = ["auto", *(pytest.param(b, marks=pytest.mark.slow) for b in ("reference", "sdpa", "sdpa_split"))]


def gda_config(**fields) -> ModelConfig:
    """Debug width (64), four signal heads of d = 8: ratio 2 gives two noise heads."""
    base = dict(attention="gda", n_heads=4, gda_ratio=2, n_kv_heads=1, lambda_std=0.3)
    return ModelConfig.from_preset("debug", **{**base, **fields})


def sharpen(module: torch.nn.Module, seed: int = 0) -> None:
    """Weights larger than init (sharp maps, so a wrong pairing shows) and random norm weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "lambda_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


# --- the float64 statement ---------------------------------------------------------------------


def interleaved_rope_float64(x, theta):
    """x (B, T, d) float64: pair (2j, 2j+1) at position p rotated by p·θ^(−2j/d)."""
    b, t, d = x.shape
    out = x.clone()
    for j in range(d // 2):
        angle = torch.arange(t, dtype=torch.float64) * theta ** (-2 * j / d)
        c, s = torch.cos(angle)[None], torch.sin(angle)[None]
        out[..., 2 * j] = x[..., 2 * j] * c - x[..., 2 * j + 1] * s
        out[..., 2 * j + 1] = x[..., 2 * j] * s + x[..., 2 * j + 1] * c
    return out


def gda_layer_float64(x, w, config: ModelConfig, layer_index: int):
    """One GDA layer, written from vLLM's GroupedDifferentialAttentionImpl.forward and MotifAttention:
    q heads in groups [signal × r, noise]; K1, V1 the even and K2, V2 the odd K/V sub-heads; signal
    head i = g·r + j against noise head g, both on K/V pair g // (N / Hkv); λ = exp(λq1·λk1) −
    exp(λq2·λk2) + λ_init; attn1 − λ·attn2; RMSNorm(2d) with weight; × (1 − λ_init); o_proj.
    Every tensor float64; ``w`` maps the module's parameter names to float64 tensors."""
    h, r, hkv, d = config.n_heads, config.gda_ratio, config.n_kv_heads, config.head_dim
    n = h // r
    b, t, _ = x.shape
    q = (x @ w["q_proj.weight"].T).view(b, t, n * (r + 1), d)
    k = (x @ w["k_proj.weight"].T).view(b, t, 2 * hkv, d)
    v = (x @ w["v_proj.weight"].T).view(b, t, 2 * hkv, d)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer_index + config.lambda_init_depth_offset))
    lam = (torch.exp((w["lambda_q1"] * w["lambda_k1"]).sum()) - torch.exp((w["lambda_q2"] * w["lambda_k2"]).sum())
           + lambda_init)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    heads = []
    for i in range(h):
        g, j = divmod(i, r)
        pair = g // (n // hkv)
        q1 = interleaved_rope_float64(q[:, :, g * (r + 1) + j], config.rope_theta)
        q2 = interleaved_rope_float64(q[:, :, g * (r + 1) + r], config.rope_theta)
        k1 = interleaved_rope_float64(k[:, :, 2 * pair], config.rope_theta)
        k2 = interleaved_rope_float64(k[:, :, 2 * pair + 1], config.rope_theta)
        values = torch.cat([v[:, :, 2 * pair], v[:, :, 2 * pair + 1]], dim=-1)  # (B, T, 2d)
        maps = []
        for qq, kk in ((q1, k1), (q2, k2)):
            scores = (qq @ kk.transpose(1, 2)) / math.sqrt(d)
            maps.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
        out = (maps[0] - lam * maps[1]) @ values  # (B, T, 2d)
        out = out / torch.sqrt((out * out).mean(-1, keepdim=True) + config.head_norm_eps) * w["head_norm.weight"]
        heads.append(out * (1 - lambda_init))
    return torch.cat(heads, dim=-1) @ w["o_proj.weight"].T


@pytest.mark.parametrize("ratio, n_kv_heads, offset", [(2, 1, 0), (2, 2, -1), (4, 1, 0), (1, 2, 0)])
def test_gda_layer_matches_its_float64_statement_forward_and_gradients(ratio, n_kv_heads, offset):
    config = gda_config(gda_ratio=ratio, n_kv_heads=n_kv_heads, lambda_init_depth_offset=offset)
    layer = GroupedDiffAttention(config, layer_index=1)
    layer.to_empty(device="cpu")
    sharpen(layer)
    x = torch.randn(2, 11, config.d_model)
    x64 = x.double()
    weights = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    expected = gda_layer_float64(x64, weights, config, layer_index=1)
    out = layer(x)
    assert (out.double() - expected).abs().max().item() < TOL
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    (expected * probe.double()).sum().backward()
    for name, p in layer.named_parameters():
        err = (p.grad.double() - weights[name].grad).abs().max().item()
        assert err < TOL * max(1.0, weights[name].grad.abs().max().item()), f"grad {name}: {err}"


# --- ratio 1 is DIFF -------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_ratio_one_is_diff_with_the_same_weights_bit_for_bit(n_kv_heads, backend):
    diff_config = ModelConfig.from_preset("debug", attention="diff", n_heads=4, n_kv_heads=n_kv_heads)
    gda = gda_config(gda_ratio=1, n_kv_heads=n_kv_heads, lambda_std=0.1)
    diff = LanguageModel(diff_config, attn_backend=backend).eval()
    sharpen(diff)
    grouped = LanguageModel(gda, attn_backend=backend).eval()
    grouped.load_state_dict(diff.state_dict())  # the same names and shapes
    tokens = torch.randint(0, 512, (2, 19))
    assert torch.equal(grouped(tokens)[0], diff(tokens)[0])
    loss_d = diff(tokens, tokens)[1]
    loss_g = grouped(tokens, tokens)[1]
    loss_d.backward()
    loss_g.backward()
    for (name, a), b in zip(diff.named_parameters(), grouped.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_ratio_one_maps_are_diffs():
    """The reference path with maps (what the evaluations tap) at ratio 1 is DIFF's, map for map."""
    diff = LanguageModel(ModelConfig.from_preset("debug", attention="diff", n_heads=4)).eval()
    sharpen(diff)
    grouped = LanguageModel(gda_config(gda_ratio=1, n_kv_heads=4)).eval()
    grouped.load_state_dict(diff.state_dict())

    class Keep(AttentionTap):
        def __init__(self):
            self.maps = []

        def record(self, layer_index, maps):
            self.maps.append(maps)

    tokens = torch.randint(0, 512, (1, 9))
    taps = []
    for model in (diff, grouped):
        with model.tap_attention(Keep()) as tap, torch.no_grad():
            model(tokens)
        taps.append(tap)
    for a, b in zip(*(t.maps for t in taps)):
        assert torch.equal(a.combined, b.combined)
        assert all(torch.equal(x, y) for x, y in zip(a.probs + a.logits, b.probs + b.logits))


# --- the op on every backend ------------------------------------------------------------------


def op_inputs(b=2, h=4, n=2, hkv=1, t=9, s=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, t, d), (b, n, t, d), (b, hkv, s, d), (b, hkv, s, d), (b, hkv, s, 2 * d)]
    tensors = [torch.randn(shape, generator=g) for shape in shapes]
    return [*tensors, torch.tensor(0.37)]


def naive_gda_float64(q1, q2, k1, k2, v, lam, causal=True):
    """Head by head in float64: signal head i with noise head i // r, both on KV head i // (H / Hkv)."""
    h, n, hkv = q1.shape[1], q2.shape[1], k1.shape[1]
    t, s, d = q1.shape[2], k1.shape[2], q1.shape[3]
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t) if causal else torch.ones(t, s, dtype=torch.bool)
    out = []
    for i in range(h):
        kv = i // (h // hkv)
        maps = [torch.softmax(((qq.double() @ kk[:, kv].double().transpose(-1, -2)) / math.sqrt(d))
                              .masked_fill(~visible, float("-inf")), dim=-1)
                for qq, kk in ((q1[:, i], k1), (q2[:, i // (h // n)], k2))]
        out.append((maps[0] - lam.double() * maps[1]) @ v[:, kv].double())
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("h, n, hkv", [(4, 2, 1), (4, 2, 2), (6, 2, 2), (3, 3, 1), (4, 1, 1)])
def test_reference_matches_the_float64_statement(h, n, hkv):
    inputs = op_inputs(h=h, n=n, hkv=hkv)
    out, maps = reference_gda_attention(*inputs)
    assert (out.double() - naive_gda_float64(*inputs)).abs().max().item() < TOL
    assert maps.probs[0].shape[1] == h and maps.probs[1].shape[1] == n and maps.combined.shape[1] == h


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_split", "math", "auto"])
@pytest.mark.parametrize("h, n, hkv, t, s", [(4, 2, 1, 9, 9), (6, 2, 2, 5, 12), (4, 4, 2, 7, 7)])
def test_backend_matches_the_reference_forward_and_gradients(backend, h, n, hkv, t, s):
    inputs = op_inputs(h=h, n=n, hkv=hkv, t=t, s=s)
    fast = [x.clone().requires_grad_() for x in inputs]
    slow = [x.clone().requires_grad_() for x in inputs]
    out = gda_attention(*fast, backend=backend)
    ref, _ = reference_gda_attention(*slow)
    assert (out - ref).abs().max().item() < TOL
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    for name, a, b in zip(("q1", "q2", "k1", "k2", "v", "lam"), fast, slow):
        err = (a.grad - b.grad).abs().max().item()
        assert err < TOL * max(1.0, b.grad.abs().max().item()), f"grad {name} ({backend}): {err}"


@pytest.mark.parametrize("backend", ["decode", "auto"])
def test_one_query_against_a_cache_matches_the_reference(backend):
    inputs = op_inputs(h=6, n=2, hkv=2, t=1, s=13)
    ref, _ = reference_gda_attention(*inputs)
    assert (gda_attention(*inputs, backend=backend) - ref).abs().max().item() < TOL


def test_flex_forward_matches_the_reference():
    """FlexAttention on the CPU runs forward only (no backward there)."""
    inputs = op_inputs(h=4, n=2, hkv=1, t=16, s=16)
    ref, _ = reference_gda_attention(*inputs)
    with torch.no_grad():
        assert (gda_attention(*inputs, backend="flex") - ref).abs().max().item() < TOL


def test_op_input_errors_name_the_problem():
    q1, q2, k1, k2, v, lam = op_inputs(h=4, n=2, hkv=1)
    with pytest.raises(ValueError, match="N dividing the signal heads H=4"):
        gda_attention(q1, torch.randn(2, 3, 9, 8), k1, k2, v, lam)
    with pytest.raises(ValueError, match="multiple of the key/value heads Hkv=2"):
        gda_attention(q1, q2[:, :1], torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 16), lam)
    with pytest.raises(ValueError, match="one mask for every head"):
        reference_gda_attention(q1, q2, k1, k2, v, lam, attn_mask=torch.ones(2, 4, 9, 9, dtype=torch.bool))


# --- the model: decoding, checkpoints, maps, config ---------------------------------------------


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_token_by_token_decoding_gives_full_forward_logits(backend, static):
    model = LanguageModel(gda_config(n_kv_heads=2, init_std=0.1), attn_backend=backend).eval()
    tokens = torch.randint(0, 512, (2, 21))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 24, static=static)
        pieces = [model(tokens[:, :7], cache=cache)[0], model(tokens[:, 7:10], cache=cache)[0]]
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(10, 21)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < TOL
    assert cache.keys[0].shape[1] == 2 * 2 and cache.values[0].shape[-1] == 2 * model.config.head_dim  # DIFF's


@pytest.mark.slow  # torch.compile traces the decoding step
def test_compiled_decoding_with_a_static_cache_compiles_once_and_follows_the_full_forward():
    assert compiled_decoding_error(LanguageModel(gda_config()).eval()) < TOL


@pytest.mark.slow  # inductor compiles the decoding step
def test_generate_with_compile_matches_eager():
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor needs a C++ compiler on CPU")
    torch._dynamo.reset()
    model = LanguageModel(gda_config()).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    eager = model.generate(prompts, 8, temperature=0)
    assert model.generate(prompts, 8, temperature=0, compile=True) == eager


def test_checkpoint_round_trip(tmp_path):
    model = LanguageModel(gda_config(attn_head_dim=12, lambda_init_depth_offset=-1)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    back = LanguageModel.from_pretrained(tmp_path / "ckpt").eval()
    assert back.config == model.config
    tokens = torch.randint(0, 512, (1, 10))
    assert torch.equal(back(tokens)[0], model(tokens)[0])


def test_maps_are_the_signed_differential_map_of_each_signal_head():
    """What the evaluations tap: p1 of every signal head, p2 of every noise head, and the map that
    multiplies V, p1_i − λ·p2_(i // r), for each signal head."""
    model = LanguageModel(gda_config(n_heads=4, gda_ratio=2, n_kv_heads=1)).eval()
    sharpen(model)

    class Keep(AttentionTap):
        maps = {}

        def record(self, layer_index, maps):
            self.maps[layer_index] = maps

    with model.tap_attention(Keep()) as tap, torch.no_grad():
        logits, _ = model(torch.randint(0, 512, (1, 9)))
        untapped = model(torch.randint(0, 512, (1, 9)))[0]  # noqa: F841 (a second call works as well)
    for i, layer in enumerate(model.layers):
        maps = tap.maps[i]
        lam = layer.attn.lam().item()
        p1, p2 = maps.probs
        assert p1.shape[1] == 4 and p2.shape[1] == 2
        for head in range(4):
            expected = p1[:, head] - lam * p2[:, head // 2]
            torch.testing.assert_close(maps.combined[:, head], expected, atol=1e-6, rtol=0)
        assert (maps.combined.sum(-1) - (1 - lam)).abs().max() < 1e-5  # each row of p1 − λp2 sums to 1 − λ


@pytest.mark.parametrize("fields, message", [
    (dict(gda_ratio=None), "gda_ratio .* must be a positive integer with attention='gda'"),
    (dict(gda_ratio=3), "n_heads=4 .* must be a multiple of gda_ratio=3"),
    (dict(gda_ratio=2, n_kv_heads=4), "n_kv_heads=4 must divide the noise heads"),
    (dict(attention="diff", gda_ratio=2), "gda_ratio applies to attention='gda' only"),
    (dict(attention="standard", attn_head_dim=16, gda_ratio=None), "attn_head_dim applies to attention"),
    (dict(value_factor=1), "value_factor must be 2 with attention='gda'"),
])
def test_invalid_gda_configs_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        gda_config(**fields)


def test_noise_heads_default_to_their_own_kv_groups_and_the_parameters_shrink():
    config = ModelConfig.from_preset("debug", attention="gda", n_heads=4, gda_ratio=2)
    assert (config.n_noise_heads, config.n_kv_heads) == (2, 2)
    e, d = config.d_model, config.head_dim
    layer = GroupedDiffAttention(config, 0)
    assert layer.q_proj.weight.shape == ((4 + 2) * d, e)  # DIFF's would be 2·4·d
    assert layer.o_proj.weight.shape == (e, 4 * 2 * d)


# --- the drop-in module -------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, num_kv_heads", [(2, None), (4, 1), (2, 1)])
def test_drop_in_module_matches_the_float64_statement(ratio, num_kv_heads):
    """MultiheadDiffAttention(gda_ratio=r): the layer's float64 statement, with its weights renamed."""
    module = MultiheadDiffAttention(64, 4, gda_ratio=ratio, num_kv_heads=num_kv_heads, depth=2)
    sharpen(module, seed=3)
    config = gda_config(gda_ratio=ratio, n_kv_heads=module.num_kv_heads)
    names = {"out_proj.weight": "o_proj.weight", "subln.weight": "head_norm.weight"}
    weights = {names.get(n, n): p.detach().double() for n, p in module.named_parameters()}
    x = torch.randn(2, 10, 64)
    expected = gda_layer_float64(x.double(), weights, config, layer_index=2)
    assert (module(x).double() - expected).abs().max().item() < TOL
    assert module.q_proj.weight.shape == ((4 + 4 // ratio) * 8, 64)
    assert f"gda_ratio={ratio}" in repr(module)


def test_drop_in_module_refuses_a_per_head_mask_and_bad_ratios():
    module = MultiheadDiffAttention(64, 4, gda_ratio=2)
    with pytest.raises(ValueError, match="one mask for every head"):
        module(torch.randn(1, 5, 64), attn_mask=torch.ones(1, 4, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="gda_ratio=3 must be a positive divisor of num_heads=4"):
        MultiheadDiffAttention(64, 4, gda_ratio=3)
    with pytest.raises(ValueError, match="divisor of the noise heads num_heads / gda_ratio = 2"):
        MultiheadDiffAttention(64, 4, gda_ratio=2, num_kv_heads=4)
