"""LanguageModel and the attention modules against the paper's formulas, written out naively."""

import math

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.config import ConfigError
from diff_transformer.attention import (
    AttentionTap,
    DiffAttention,
    DiffSymmetricAttention,
    DiffV2Attention,
    StandardAttention,
)
from diff_transformer.attention import GatedAttention

KINDS = ["standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise"]
# (kind, n_kv_heads): MHA and MQA for every kind but the symmetric one, whose keys are its queries
KIND_AND_KV_HEADS = [(kind, kv) for kind in KINDS for kv in (None, 1) if not (kind == "diff_symmetric" and kv)]


def rope_complex(x, theta):
    """Interleaved RoPE via complex numbers: pair (x[2i], x[2i+1]) is one complex number."""
    t, d = x.shape[-3], x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)[:, None, :]).flatten(-2)


def causal_softmax(logits):
    t = logits.shape[-1]
    return logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


def naive_diff_module(m: DiffAttention, x):
    """The paper's equations (§2.1, multi-head DIFF with the authors' layout) line by line, in float64, \
one DIFF head at a time."""
    cfg, d = m.config, m.head_dim
    b, t, _ = x.shape
    x = x.double()
    q = rope_complex((x @ m.q_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, 2H, d)
    k = rope_complex((x @ m.k_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, 2Hkv, d)
    v = (x @ m.v_proj.weight.double().T).view(b, t, -1, cfg.value_factor * d)  # 2d wide; d with value_factor=1
    lam = (
        torch.exp((m.lambda_q1.double() * m.lambda_k1.double()).sum())
        - torch.exp((m.lambda_q2.double() * m.lambda_k2.double()).sum())
        + m.lambda_init
    )
    heads = []
    for h in range(cfg.n_heads):
        g = h // (cfg.n_heads // cfg.n_kv_heads)
        a1 = causal_softmax(q[:, :, 2 * h] @ k[:, :, 2 * g].transpose(-1, -2) / math.sqrt(d))
        a2 = causal_softmax(q[:, :, 2 * h + 1] @ k[:, :, 2 * g + 1].transpose(-1, -2) / math.sqrt(d))
        head = (a1 - lam * a2) @ v[:, :, g]  # (B, T, 2d)
        if m.head_norm is not None:
            head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + 1e-5) * m.head_norm.weight.double()
        heads.append(head * (1 - m.lambda_init))
    return torch.cat(heads, -1) @ m.o_proj.weight.double().T


def naive_standard_module(m: StandardAttention, x):
    cfg, d = m.config, m.head_dim
    b, t, _ = x.shape
    x = x.double()
    q = rope_complex((x @ m.q_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)
    k = rope_complex((x @ m.k_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)
    v = (x @ m.v_proj.weight.double().T).view(b, t, -1, d)
    heads = []
    for h in range(cfg.n_heads):
        g = h // (cfg.n_heads // cfg.n_kv_heads)
        head = causal_softmax(q[:, :, h] @ k[:, :, g].transpose(-1, -2) / math.sqrt(d)) @ v[:, :, g]
        if m.head_norm is not None:
            head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + 1e-5) * m.head_norm.weight.double()
        heads.append(head)
    return torch.cat(heads, -1) @ m.o_proj.weight.double().T


def naive_v2_module(m: DiffV2Attention, x):
    """DIFF V2 (the authors' Diff-Transformer-V2): attention over 2H query heads, \
out_h = attn_2h − sigmoid(x W_λ)_h · attn_2h+1."""
    cfg, d = m.config, m.head_dim
    b, t, _ = x.shape
    x = x.double()
    q = rope_complex((x @ m.q_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, 2H, d)
    k = rope_complex((x @ m.k_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)
    v = (x @ m.v_proj.weight.double().T).view(b, t, -1, d)
    lam = torch.sigmoid(x @ m.lambda_proj.weight.double().T)  # (B, T, H)
    group = 2 * cfg.n_heads // cfg.n_kv_heads

    def head(i):
        return causal_softmax(q[:, :, i] @ k[:, :, i // group].transpose(-1, -2) / math.sqrt(d)) @ v[:, :, i // group]

    heads = [head(2 * h) - lam[..., h : h + 1] * head(2 * h + 1) for h in range(cfg.n_heads)]
    return torch.cat(heads, -1) @ m.o_proj.weight.double().T


def naive_symmetric_module(m: DiffSymmetricAttention, x):
    """Symmetric DIFF in float64, one head at a time: DIFF with Q1 = K1 and Q2 = K2, both from qk_proj."""
    cfg, d = m.config, m.head_dim
    b, t, _ = x.shape
    x = x.double()
    qk = rope_complex((x @ m.qk_proj.weight.double().T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, 2H, d)
    v = (x @ m.v_proj.weight.double().T).view(b, t, -1, 2 * d)
    lam = (
        torch.exp((m.lambda_q1.double() * m.lambda_k1.double()).sum())
        - torch.exp((m.lambda_q2.double() * m.lambda_k2.double()).sum())
        + m.lambda_init
    )
    heads = []
    for h in range(cfg.n_heads):
        a1 = causal_softmax(qk[:, :, 2 * h] @ qk[:, :, 2 * h].transpose(-1, -2) / math.sqrt(d))
        a2 = causal_softmax(qk[:, :, 2 * h + 1] @ qk[:, :, 2 * h + 1].transpose(-1, -2) / math.sqrt(d))
        head = (a1 - lam * a2) @ v[:, :, h]
        head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + 1e-5) * m.head_norm.weight.double()
        heads.append(head * (1 - m.lambda_init))
    return torch.cat(heads, -1) @ m.o_proj.weight.double().T


def naive_gated_module(m: GatedAttention, x, weights=None):
    """Gated attention (Qiu et al. 2025, gate G1) in float64, one head at a time: head h of the standard
    kind times sigmoid(x W_g) of its channels (gated: d gates per head) or of its one gate (gated_headwise).
    ``weights``: {"q_proj.weight": ..., ...} to use instead of the module's (float64 leaves, for gradients)."""
    cfg, d = m.config, m.head_dim
    w = weights or {name: p.double() for name, p in m.named_parameters()}
    b, t, _ = x.shape
    x = x.double()
    q = rope_complex((x @ w["q_proj.weight"].T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, H, d)
    k = rope_complex((x @ w["k_proj.weight"].T).view(b, t, -1, d), cfg.rope_theta)  # (B, T, Hkv, d)
    v = (x @ w["v_proj.weight"].T).view(b, t, -1, d)
    gates = torch.sigmoid(x @ w["gate_proj.weight"].T).view(b, t, cfg.n_heads, -1)  # (B, T, H, d or 1)
    heads = []
    for h in range(cfg.n_heads):
        g = h // (cfg.n_heads // cfg.n_kv_heads)
        head = causal_softmax(q[:, :, h] @ k[:, :, g].transpose(-1, -2) / math.sqrt(d)) @ v[:, :, g]  # (B, T, d)
        heads.append(head * gates[:, :, h])
    return torch.cat(heads, -1) @ w["o_proj.weight"].T


NAIVE = {"standard": naive_standard_module, "diff": naive_diff_module, "diff_v2": naive_v2_module,
         "diff_symmetric": naive_symmetric_module, "gated": naive_gated_module, "gated_headwise": naive_gated_module}


def randomise(model):
    """Non-trivial values for the tensors init leaves at 1 (norm weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("kind, n_kv_heads", KIND_AND_KV_HEADS)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split", "math"])
def test_attention_module_matches_naive_formulas(kind, n_kv_heads, backend):
    overrides = dict(head_norm=True) if kind == "standard" else {}
    config = ModelConfig.from_preset("debug", attention=kind, n_kv_heads=n_kv_heads, **overrides)
    model = LanguageModel(config, attn_backend=backend)
    randomise(model)
    module = model.layers[1].attn
    x = torch.randn(2, 19, config.d_model)
    out = module(x)
    expected = NAIVE[kind](module, x)
    assert out.shape == x.shape
    assert (out.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("head_norm", [False, True])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split", "math"])
def test_diff_heads_with_values_of_width_d_match_the_naive_formulas(n_kv_heads, head_norm, backend):
    """value_factor=1 (what convert --init exact builds): H DIFF heads of two d-wide groups and a
    d-wide value, d = d_model / H, with λ ≠ 0, with and without the head norm, MHA and GQA."""
    config = ModelConfig.from_preset("debug", attention="diff", n_heads=4, n_kv_heads=n_kv_heads, value_factor=1,
                                     head_norm=head_norm)
    model = LanguageModel(config, attn_backend=backend)
    randomise(model)
    module = model.layers[1].attn
    d = config.d_model // 4
    assert config.head_dim == d and module.v_proj.weight.shape == (config.n_kv_heads * d, config.d_model)
    assert module.q_proj.weight.shape == (2 * 4 * d, config.d_model) and abs(module.lam().item()) > 0.1
    x = torch.randn(2, 19, config.d_model)
    assert (module(x).double() - naive_diff_module(module, x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 3, 4, 8)])
def test_rms_norm_and_its_gradients_match_the_formula(shape, dtype):
    """rms_norm (in fp32, cast back) against x / sqrt(mean x² + eps) · w in float64 with autograd,
    forward and both gradients."""
    from diff_transformer.attention import rms_norm

    eps = 1e-5
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    w = torch.empty(shape[-1]).uniform_(0.5, 1.5).requires_grad_()
    grad = torch.randn(shape).to(dtype)
    out = rms_norm(x, w, eps)
    out.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    expected.backward(grad.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output and x's gradient are rounded to 8 bits
    assert out.dtype == dtype
    assert torch.allclose(out.double(), expected, rtol=tol, atol=tol)
    assert torch.allclose(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    assert torch.allclose(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)  # the weight's gradient is fp32


@pytest.mark.parametrize("b, t", [(1, 1), (8, 1), (2, 32), (5, 13)])  # rows 8 and 64: (W·xᵀ)ᵀ; 1 and 65: x·Wᵀ
def test_head_logits_match_the_product_for_few_and_many_rows(b, t):
    """Up to FEW_HEAD_ROWS rows the head is computed as (W·xᵀ)ᵀ on CPU: the same logits as x·Wᵀ
    (in float64), contiguous, shaped (B, T, V)."""
    from diff_transformer.model import _head_logits

    x, weight = torch.randn(b, t, 24), torch.randn(300, 24)
    logits = _head_logits(x, weight)
    expected = x.double() @ weight.double().T
    assert logits.shape == (b, t, 300) and logits.is_contiguous()
    assert torch.allclose(logits.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes_loss_and_gradients(kind):
    config = ModelConfig.from_preset("debug", attention=kind)
    model = LanguageModel(config)
    tokens = torch.randint(0, config.vocab_size, (3, 20))
    logits, loss = model(tokens, tokens)
    assert logits.shape == (3, 20, config.vocab_size)
    # at init the prediction is close to uniform
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"
    assert model(tokens)[1] is None


@pytest.mark.slow  # torch.compile traces forward and backward
def test_a_training_step_compiles_into_one_graph_with_the_eager_gradients():
    """torch.compile(fullgraph=True) traces DIFF's training forward and backward ("auto": the
    "math" backend, whose backward writes each query tile's gradient without graph breaks) and
    gives the eager loss and gradients (aot_eager: the traced graph without inductor)."""
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff"))
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    model(tokens, tokens, return_logits=False)[1].backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(tokens, tokens, return_logits=False)[1]
    loss.backward()
    assert abs(loss.item() - model(tokens, tokens)[1].item()) < 1e-5
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("keep", [1, 3, 20])
def test_logits_to_keep_gives_the_last_rows(keep):
    """logits_to_keep=N: the last N rows of the full logits (all of them when N >= T); with a cache
    the cache fills as without it."""
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff")).eval()
    tokens = torch.randint(0, 512, (2, 12))
    full, _ = model(tokens)
    kept, _ = model(tokens, logits_to_keep=keep)
    assert kept.shape == (2, min(keep, 12), 512)
    torch.testing.assert_close(kept, full[:, -keep:], atol=1e-5, rtol=1e-5)
    cache = model.new_cache(2, 13)
    model(tokens, cache=cache, logits_to_keep=keep)
    step, _ = model(tokens[:, :1], cache=cache)
    torch.testing.assert_close(step, model(torch.cat([tokens, tokens[:, :1]], 1))[0][:, -1:], atol=1e-5, rtol=1e-5)


def test_ignored_targets_do_not_count():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    tokens = torch.randint(0, 512, (2, 10))
    targets = tokens.clone()
    targets[:, :5] = -100
    _, loss = model(tokens, targets)
    logits, _ = model(tokens)
    expected = F.cross_entropy(logits[:, 5:].flatten(0, 1), tokens[:, 5:].flatten())
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_causality(kind):
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind))
    a = torch.randint(0, 512, (1, 16))
    b = a.clone()
    b[0, 10:] = torch.randint(0, 512, (6,))
    torch.testing.assert_close(model(a)[0][:, :10], model(b)[0][:, :10], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_gives_the_unpadded_logits(kind):
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind))
    seq = torch.randint(1, 512, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), seq], dim=1)
    real = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 9, dtype=torch.bool)], dim=1)
    alone, _ = model(seq)
    logits, _ = model(padded, padding_mask=real)
    torch.testing.assert_close(logits[:, 4:], alone, atol=1e-5, rtol=0)
    assert torch.isfinite(logits).all()


def test_lambda_initialisation():
    config = ModelConfig.from_preset("small", attention="diff")
    model = LanguageModel(config)
    vectors = torch.cat([p.flatten() for n, p in model.named_parameters() if "lambda_" in n])
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lambda_" in n)
    assert vectors.numel() == 4 * config.head_dim * config.n_layers
    assert 0.09 < vectors.std().item() < 0.11 and abs(vectors.mean().item()) < 0.02
    for i, layer in enumerate(model.layers):
        a = layer.attn
        dot1, dot2 = (a.lambda_q1 @ a.lambda_k1).item(), (a.lambda_q2 @ a.lambda_k2).item()
        expected = math.exp(dot1) - math.exp(dot2) + config.lambda_init_for(i)
        assert model.lambdas()[i] == pytest.approx(expected, abs=1e-6)
        assert a.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * i))


def test_init_weights_is_explicit_and_deterministic():
    config = ModelConfig.from_preset("debug")
    meta = LanguageModel(config, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(torch.Generator().manual_seed(3))
    again = LanguageModel(config, device="meta")
    again.to_empty(device="cpu")
    again.init_weights(torch.Generator().manual_seed(3))
    for (name, a), (_, b) in zip(meta.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(meta.norm.weight, torch.ones(config.d_model))
    out_std = meta.layers[0].attn.o_proj.weight.std().item()
    assert out_std == pytest.approx(config.init_std / math.sqrt(2 * config.n_layers), rel=0.1)
    plain = LanguageModel(ModelConfig.from_preset("debug", scale_residual_init=False))
    for layer in plain.layers:  # HF Llama's rule: every matrix at init_std
        assert layer.attn.o_proj.weight.std().item() == pytest.approx(config.init_std, rel=0.1)
        assert layer.ffn.down_proj.weight.std().item() == pytest.approx(config.init_std, rel=0.1)


def test_the_ambient_device_is_honoured():
    config = ModelConfig.from_preset("debug")
    with torch.device("meta"):
        meta = LanguageModel(config)
    assert all(p.is_meta for p in meta.parameters())
    assert all(p.device.type == "cpu" for p in LanguageModel(config).parameters())


def test_no_biases_and_tied_embeddings():
    model = LanguageModel(ModelConfig.from_preset("debug", tie_embeddings=True))
    assert model.lm_head is None
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    final_hidden = []
    model.norm.register_forward_hook(lambda module, args, out: final_hidden.append(out))
    logits, _ = model(torch.randint(0, 512, (1, 5)))
    torch.testing.assert_close(logits, final_hidden[0] @ model.embed.weight.T)


def test_bad_inputs():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="tokens must be \\(batch, length\\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="padding_mask must be bool"):
        model(torch.zeros(1, 4, dtype=torch.long), padding_mask=torch.ones(1, 3, dtype=torch.bool))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    for keep, targets in [(-1, None), (1, tokens), (1.5, None)]:
        with pytest.raises(ValueError, match="logits_to_keep must be an integer >= 0, and 0 with targets"):
            model(tokens, targets, logits_to_keep=keep)
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.set_attention_backend("nope")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        LanguageModel(ModelConfig.from_preset("debug"), attn_backend="nope")


def test_the_backend_is_a_runtime_setting_of_every_layer():
    config = ModelConfig.from_preset("debug")
    model = LanguageModel(config, attn_backend="reference")
    assert model.attn_backend == "reference" and {layer.attn.backend for layer in model.layers} == {"reference"}
    model.set_attention_backend("sdpa")
    assert {layer.attn.backend for layer in model.layers} == {"sdpa"}
    assert "attn_backend" not in config.to_dict()
    with pytest.raises(ConfigError, match="attn_backend is a runtime setting"):
        ModelConfig.from_dict({**config.to_dict(), "attn_backend": "sdpa"})


def test_each_module_initialises_its_own_tensors():
    """The model's init_weights delegates: re-running one block's init_weights with a generator
    gives the values that a fresh generator drawn in the documented order gives (embed, then per
    layer attention q, k, v, o, λ vectors and FFN gate, up, down)."""
    config = ModelConfig.from_preset("debug", attention="diff")
    model = LanguageModel(config)
    std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
    model.layers[1].init_weights(std, out_std, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    a, f = model.layers[1].attn, model.layers[1].ffn
    expected = [
        (a.q_proj.weight, std), (a.k_proj.weight, std), (a.v_proj.weight, std), (a.o_proj.weight, out_std),
        *[(vec, config.lambda_std) for vec in (a.lambda_q1, a.lambda_k1, a.lambda_q2, a.lambda_k2)],
        (f.gate_proj.weight, std), (f.up_proj.weight, std), (f.down_proj.weight, out_std),
    ]
    for tensor, scale in expected:
        torch.testing.assert_close(tensor, torch.empty_like(tensor).normal_(0.0, scale, generator=g), atol=0, rtol=0)
    assert torch.equal(a.head_norm.weight, torch.ones(2 * config.head_dim))


def test_symmetric_diff_scores_are_symmetric_and_its_layout_is_one_projection():
    """Q1 = K1 and Q2 = K2: every pre-softmax score matrix (before the causal mask) equals its
    transpose, RoPE included; the layer has qk_proj (E × E) and no q_proj / k_proj."""

    class Logits(AttentionTap):
        def __init__(self):
            self.seen = []

        def transform_logits(self, layer_index, logits, visible):
            self.seen.append(logits)
            return logits

    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff_symmetric"))
    attn = model.layers[0].attn
    e = model.config.d_model
    assert {n.split(".")[0] for n, _ in attn.named_parameters()} == {
        "qk_proj", "v_proj", "o_proj", "head_norm", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}
    assert attn.qk_proj.weight.shape == (e, e)
    with model.tap_attention(Logits()) as tap:
        model(torch.randint(0, 512, (2, 17)))
    assert len(tap.seen) == 2 * model.config.n_layers  # two maps per layer
    for logits in tap.seen:  # (B, H, T, T)
        torch.testing.assert_close(logits, logits.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    diff = LanguageModel(ModelConfig.from_preset("debug", attention="diff"))
    with diff.tap_attention(Logits()) as tap:  # the control: DIFF's separate keys give asymmetric scores
        diff(torch.randint(0, 512, (2, 17)))
    assert all((logits - logits.transpose(-1, -2)).abs().max() > 1e-3 for logits in tap.seen)
