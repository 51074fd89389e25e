"""MultiheadDiffAttention, the drop-in module, against a float64 oracle of the paper's formula
written out here (the authors' layout), against the model's own DIFF layer, and in a small encoder."""

import importlib.util
import math
import os

import pytest
import torch
from torch import nn

from diff_transformer import MultiheadDiffAttention
from diff_transformer.interop.unilm import attention_from_unilm

BACKENDS = ["reference", "sdpa", "sdpa_split", "math", "auto"]
TOL = 1e-5  # fp32 module against the float64 oracle, absolute


def authors_state_dict(embed_dim, num_heads, num_kv_heads, generator):
    """Random weights under the names and shapes of the authors' MultiheadDiffAttn."""
    n_rep = num_heads // (num_kv_heads or num_heads)
    d = embed_dim // num_heads // 2

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=generator) * std

    return {
        "q_proj.weight": w(embed_dim, embed_dim), "k_proj.weight": w(embed_dim // n_rep, embed_dim),
        "v_proj.weight": w(embed_dim // n_rep, embed_dim), "out_proj.weight": w(embed_dim, embed_dim),
        "lambda_q1": w(d, std=0.3), "lambda_k1": w(d, std=0.3), "lambda_q2": w(d, std=0.3), "lambda_k2": w(d, std=0.3),
        "subln.weight": 1 + w(2 * d, std=0.2),
    }


def oracle(sd, x, *, num_heads, num_kv_heads, lambda_init, causal, rope_theta, mask=None):
    """The formula in float64, one DIFF head and one map at a time. ``mask`` (B, T, T) bool or None."""
    b, t, e = x.shape
    hkv = num_kv_heads or num_heads
    d = e // num_heads // 2
    x = x.double()
    q = (x @ sd["q_proj.weight"].double().T).view(b, t, 2 * num_heads, d)
    k = (x @ sd["k_proj.weight"].double().T).view(b, t, 2 * hkv, d)
    v = (x @ sd["v_proj.weight"].double().T).view(b, t, hkv, 2 * d)
    if rope_theta is not None:  # interleaved: rotate (x[2i], x[2i+1]) by position · θ^(−2i/d)
        angle = (torch.arange(t, dtype=torch.float64)[:, None]
                 * rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, d/2)

        def rotate(z):
            even, odd = z[..., 0::2], z[..., 1::2]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

        q, k = rotate(q), rotate(k)
    lam = (torch.exp((sd["lambda_q1"].double() * sd["lambda_k1"].double()).sum())
           - torch.exp((sd["lambda_q2"].double() * sd["lambda_k2"].double()).sum()) + lambda_init)
    visible = torch.ones(b, t, t, dtype=torch.bool)
    if causal:
        visible &= torch.ones(t, t, dtype=torch.bool).tril()
    if mask is not None:
        visible &= mask
    heads = []
    for h in range(num_heads):
        g = h // (num_heads // hkv)
        maps = [(q[:, :, 2 * h + c] @ k[:, :, 2 * g + c].transpose(-1, -2) / math.sqrt(d))
                .masked_fill(~visible, float("-inf")).softmax(-1) for c in (0, 1)]
        head = (maps[0] - lam * maps[1]) @ v[:, :, g]  # (B, T, 2d)
        head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["subln.weight"].double()
        heads.append(head * (1 - lambda_init))
    return torch.cat(heads, -1) @ sd["out_proj.weight"].double().T


# (embed_dim, num_heads, num_kv_heads, T, rope_theta)
SHAPES = {
    "mha": (64, 2, None, 13, 10000.0),
    "gqa": (128, 4, 2, 9, 10000.0),
    "mqa-no-rope": (96, 3, 1, 11, None),
}


# The fused kernel: on CUDA, or in Triton's interpreter on CPU (conftest.py sets TRITON_INTERPRET=1 there).
TRITON = pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton, and CUDA or TRITON_INTERPRET=1")])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", [*BACKENDS, TRITON])
def test_forward_and_gradients_match_the_float64_oracle(shape, causal, backend):
    embed_dim, heads, kv_heads, t, theta = SHAPES[shape]
    g = torch.Generator().manual_seed(t)
    sd = authors_state_dict(embed_dim, heads, kv_heads, g)
    module = MultiheadDiffAttention(embed_dim, heads, num_kv_heads=kv_heads, depth=3, causal=causal,
                                    rope_theta=theta, backend=backend)
    module.load_state_dict(sd)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    module.to(device)
    x = torch.randn(2, t, embed_dim, generator=g).to(device).requires_grad_()
    out = module(x)
    sd64 = {name: p.detach().double().requires_grad_() for name, p in sd.items()}
    x64 = x.detach().cpu().double().requires_grad_()
    expected = oracle(sd64, x64, num_heads=heads, num_kv_heads=kv_heads, lambda_init=0.8 - 0.6 * math.exp(-0.9),
                      causal=causal, rope_theta=theta)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert (out.cpu().double() - expected).abs().max().item() < TOL
    grad_out = torch.randn(out.shape, generator=g)
    out.backward(grad_out.to(device))
    expected.backward(grad_out.double())
    grads = {"x": (x.grad, x64.grad), **{name: (p.grad, sd64[name].grad) for name, p in module.named_parameters()}}
    assert set(grads) == {"x", *sd}
    for name, (got, want) in grads.items():
        err = (got.cpu().double() - want).abs().max().item()
        assert err < TOL * max(1.0, want.abs().max().item()), f"grad {name}: {err}"


def test_causal_and_not_differ_and_only_the_causal_one_ignores_the_future():
    torch.manual_seed(0)
    encoder, decoder = MultiheadDiffAttention(64, 2, causal=False), MultiheadDiffAttention(64, 2)
    decoder.load_state_dict(encoder.state_dict())
    x = torch.randn(1, 10, 64)
    changed = x.clone()
    changed[:, 7:] = torch.randn(1, 3, 64)
    torch.testing.assert_close(decoder(changed)[:, :7], decoder(x)[:, :7], atol=1e-6, rtol=0)
    assert (encoder(changed)[:, :7] - encoder(x)[:, :7]).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_padding_mask_matches_the_oracle(causal, backend):
    """attn_mask (B, 1, 1, T): batch row 1 has three padded keys at the end (ops convention, True = may attend)."""
    g = torch.Generator().manual_seed(1)
    sd = authors_state_dict(64, 2, None, g)
    module = MultiheadDiffAttention(64, 2, causal=causal, backend=backend)
    module.load_state_dict(sd)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9:] = False
    x = torch.randn(2, 12, 64, generator=g)
    out = module(x, attn_mask=keep[:, None, None, :])
    expected = oracle(sd, x, num_heads=2, num_kv_heads=None, lambda_init=0.2, causal=causal, rope_theta=10000.0,
                      mask=keep[:, None, :].expand(2, 12, 12))
    assert (out.double() - expected).abs().max().item() < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_a_single_position_goes_to_the_decode_path_and_is_right(causal, monkeypatch):
    """T = 1 (a one-token sequence, or a ViT's [CLS]-only input): "auto" picks the decode backend,
    which computes the same as the formula whether or not the module is causal."""
    import diff_transformer.ops as ops

    chosen = []
    resolve = ops.resolve_backend
    monkeypatch.setattr(ops, "resolve_backend", lambda *a, **kw: chosen.append(resolve(*a, **kw)) or chosen[-1])
    g = torch.Generator().manual_seed(2)
    sd = authors_state_dict(64, 2, 1, g)
    module = MultiheadDiffAttention(64, 2, num_kv_heads=1, causal=causal)
    module.load_state_dict(sd)
    x = torch.randn(3, 1, 64, generator=g)
    out = module(x)
    assert chosen == ["decode"]
    expected = oracle(sd, x, num_heads=2, num_kv_heads=1, lambda_init=0.2, causal=causal, rope_theta=10000.0)
    assert (out.double() - expected).abs().max().item() < TOL


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_an_authors_state_dict_loads_unchanged_and_equals_the_models_layer(kv_heads):
    """Their names and shapes load as they are (strict), and the module computes what
    ``attention_from_unilm`` (the model's DiffAttention with those weights) computes."""
    g = torch.Generator().manual_seed(3)
    sd = authors_state_dict(128, 4, kv_heads, g)
    module = MultiheadDiffAttention(128, 4, num_kv_heads=kv_heads, depth=5)
    assert sorted(module.state_dict()) == sorted(sd)
    module.load_state_dict(sd, strict=True)
    layer = attention_from_unilm(sd, embed_dim=128, depth=5, num_heads=4, num_kv_heads=kv_heads)
    x = torch.randn(2, 21, 128, generator=g)
    torch.testing.assert_close(module(x), layer(x), atol=1e-6, rtol=1e-6)
    assert module.lambda_init == layer.lambda_init and module.lam().item() == pytest.approx(layer.lam().item())


def authors_naive_file(sd, x, *, num_heads, num_kv_heads, lambda_init, rope_theta):
    """The forward of the authors' naive multihead_diffattn.py (causal), in float64 as it is written
    there: ``repeat_kv`` repeats each of the 2·Hkv key sub-heads n_rep times, so query sub-head j
    reads key sub-head j // n_rep; value group h // n_rep serves head h."""
    from test_model import rope_complex

    b, t, e = x.shape
    hkv = num_kv_heads or num_heads
    n_rep, d, x = num_heads // hkv, e // num_heads // 2, x.double()
    q = rope_complex((x @ sd["q_proj.weight"].double().T).view(b, t, 2 * num_heads, d), rope_theta).transpose(1, 2)
    k = rope_complex((x @ sd["k_proj.weight"].double().T).view(b, t, 2 * hkv, d), rope_theta).transpose(1, 2)
    v = (x @ sd["v_proj.weight"].double().T).view(b, t, hkv, 2 * d).transpose(1, 2)
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # repeat_kv
    w = (q @ k.mT / math.sqrt(d)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    lam = (torch.exp((sd["lambda_q1"].double() * sd["lambda_k1"].double()).sum())
           - torch.exp((sd["lambda_q2"].double() * sd["lambda_k2"].double()).sum()) + lambda_init)
    w = w.view(b, num_heads, 2, t, t)
    attn = (w[:, :, 0] - lam * w[:, :, 1]) @ v  # (B, H, T, 2d)
    attn = (attn / torch.sqrt(attn.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["subln.weight"].double()
            * (1 - lambda_init))
    return attn.transpose(1, 2).reshape(b, t, e) @ sd["out_proj.weight"].double().T


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_a_gqa_state_dict_of_the_authors_naive_file_computes_something_else(kv_heads):
    """As documented: with MHA the module equals the authors' naive file; with GQA it pairs keys as
    their flash files (the float64 oracle above) and so differs from the naive file."""
    g = torch.Generator().manual_seed(4)
    sd = authors_state_dict(128, 4, kv_heads, g)
    module = MultiheadDiffAttention(128, 4, num_kv_heads=kv_heads, depth=2)
    module.load_state_dict(sd, strict=True)
    x = torch.randn(2, 9, 128, generator=g)
    with torch.no_grad():
        ours = module(x).double()
    naive = authors_naive_file(sd, x, num_heads=4, num_kv_heads=kv_heads, lambda_init=module.lambda_init,
                               rope_theta=10000.0)
    if kv_heads is None:
        assert (ours - naive).abs().max().item() < TOL
    else:
        assert (ours - naive).abs().max().item() > 0.05
        flash = oracle(sd, x, num_heads=4, num_kv_heads=kv_heads, lambda_init=module.lambda_init, causal=True,
                       rope_theta=10000.0)
        assert (ours - flash).abs().max().item() < TOL


def test_lambda_init_schedule_and_constant():
    assert MultiheadDiffAttention(64, 2).lambda_init == pytest.approx(0.2)  # depth 0
    assert MultiheadDiffAttention(64, 2, depth=4).lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.2))
    assert MultiheadDiffAttention(64, 2, depth=4, lambda_init=0.5).lambda_init == 0.5
    m = MultiheadDiffAttention(64, 2, depth=1)
    with torch.no_grad():
        for vec, value in ((m.lambda_q1, 0.1), (m.lambda_k1, 0.2), (m.lambda_q2, -0.1), (m.lambda_k2, 0.3)):
            vec.fill_(value)
    # d = 16: λ = exp(16 · 0.02) − exp(16 · −0.03) + λ_init
    assert m.lam().item() == pytest.approx(math.exp(0.32) - math.exp(-0.48) + 0.8 - 0.6 * math.exp(-0.3), abs=1e-6)


BAD_ARGUMENTS = [
    (dict(lambda_init=float("nan")),
     r"lambda_init must be a number in \[0, 1\), or None for the depth schedule; got nan"),
    (dict(lambda_init=1.0), r"lambda_init must be a number in \[0, 1\).*got 1\.0"),
    (dict(lambda_init=-3), r"lambda_init must be a number in \[0, 1\).*got -3"),
    (dict(lambda_init="0.5"), r"lambda_init must be a number in \[0, 1\).*got '0\.5'"),
    (dict(embed_dim=0), r"embed_dim must be a positive integer, got 0"),
    (dict(embed_dim=64.0), r"embed_dim must be a positive integer, got 64\.0"),
    (dict(num_heads=-2), r"num_heads must be a positive integer, got -2"),
    (dict(num_heads=True), r"num_heads must be a positive integer, got True"),
    (dict(num_kv_heads=0), r"num_kv_heads=0 must be a positive divisor of num_heads=2"),
    (dict(num_kv_heads=2.0), r"num_kv_heads=2\.0 must be a positive divisor"),
    (dict(depth=1.5), r"depth must be a 0-based layer index \(an integer >= 0\), got 1\.5"),
    (dict(rope_theta=0.0), r"rope_theta must be a positive finite number, or None .*; got 0\.0"),
    (dict(rope_theta=float("inf")), r"rope_theta must be a positive finite number.*got inf"),
    (dict(rope_theta=float("nan")), r"rope_theta must be a positive finite number.*got nan"),
    (dict(rope_theta="10000"), r"rope_theta must be a positive finite number.*got '10000'"),
    (dict(causal="yes"), r"causal must be True or False, got 'yes'"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ARGUMENTS,
                         ids=[",".join(f"{k}={v!r}" for k, v in kwargs.items()) for kwargs, _ in BAD_ARGUMENTS])
def test_every_constructor_argument_is_checked_and_named(kwargs, message):
    """As ModelConfig refuses them: λ_init outside [0, 1) (1 zeroes the output, NaN poisons it),
    θ that is not a positive finite number, sizes that are not positive integers."""
    args = {"embed_dim": 64, "num_heads": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiheadDiffAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_lambda_init_accepts_the_range_modelconfig_accepts():
    assert MultiheadDiffAttention(64, 2, lambda_init=0).lambda_init == 0.0
    assert MultiheadDiffAttention(64, 2, lambda_init=0.999).lambda_init == 0.999
    assert MultiheadDiffAttention(64, 2, rope_theta=640_000).rope_theta == 640_000


def test_bad_arguments_and_inputs_are_named():
    with pytest.raises(ValueError, match=r"embed_dim=100 must be divisible by 2 \* num_heads = 6"):
        MultiheadDiffAttention(100, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3 must be a positive divisor of num_heads=4"):
        MultiheadDiffAttention(128, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim .* = 9 must be even for RoPE"):
        MultiheadDiffAttention(36, 2)
    MultiheadDiffAttention(36, 2, rope_theta=None)  # no RoPE: an odd head width is fine
    with pytest.raises(ValueError, match="depth must be a 0-based layer index"):
        MultiheadDiffAttention(64, 2, depth=-1)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        MultiheadDiffAttention(64, 2, backend="flash")
    m = MultiheadDiffAttention(64, 2)
    with pytest.raises(ValueError, match=r"x must be \(batch, length, embed_dim=64\) with at least one position, "
                                         r"got \(2, 5, 32\)"):
        m(torch.randn(2, 5, 32))
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor"):
        m(torch.randn(2, 5, 64), attn_mask=torch.ones(5, 5))
    with pytest.raises(ValueError,
                       match=r"does not broadcast to \(B, H, T, T\) = \(2, 2, 5, 5\).*mask\[:, None, None, :\]"):
        m(torch.randn(2, 5, 64), attn_mask=torch.ones(2, 5, dtype=torch.bool))


class TinyViT(nn.Module):
    """A 2-block encoder classifier on patch vectors: DIFF attention without RoPE or a causal mask."""

    def __init__(self, patch_dim, num_patches, num_classes, dim=64, heads=2):
        super().__init__()
        self.embed = nn.Linear(patch_dim, dim)
        self.position = nn.Parameter(torch.randn(num_patches, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "attn": MultiheadDiffAttention(dim, heads, depth=i, causal=False, rope_theta=None),
                "norm2": nn.LayerNorm(dim),
                "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
            }) for i in range(2)
        )
        self.head = nn.Linear(dim, num_classes)

    def forward(self, patches):
        x = self.embed(patches) + self.position
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x.mean(1))


@pytest.mark.slow  # trains (6 s)
def test_a_small_encoder_trains():
    """Random patches, random labels: ten steps of Adam fit the batch (the loss falls fourfold),
    every parameter of both attention modules gets a gradient, and λ moves."""
    torch.manual_seed(0)
    model = TinyViT(patch_dim=48, num_patches=16, num_classes=10)
    patches, labels = torch.randn(32, 16, 48), torch.randint(0, 10, (32,))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    lam_before = [b["attn"].lam().item() for b in model.blocks]
    losses = []
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(patches), labels)
        optimizer.zero_grad()
        loss.backward()
        for block in model.blocks:
            for name, p in block["attn"].named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses
    assert [b["attn"].lam().item() for b in model.blocks] != lam_before
