"""The single-query "decode" backend: against the reference, and decoding a whole model with it."""

from __future__ import annotations

import pytest
import torch

from diff_transformer.config import ModelConfig
from diff_transformer.model import LanguageModel
from diff_transformer.ops import diff_attention, resolve_backend
from diff_transformer.ops.decode import decode_diff_attention_packed


def single_query_inputs(b, h, hkv, s, d, *, lam_per_head):
    q1, q2 = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
    k1, k2 = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    v = torch.randn(b, hkv, s, 2 * d)
    lam = torch.rand(h) + 0.2 if lam_per_head else torch.tensor(0.6)
    return q1, q2, k1, k2, v, lam


@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("lam_per_head", [False, True], ids=["lam0d", "lam-per-head"])
def test_decode_matches_reference(h, hkv, lam_per_head):
    inputs = single_query_inputs(2, h, hkv, 37, 16, lam_per_head=lam_per_head)
    got = diff_attention(*inputs, backend="decode")
    want = diff_attention(*inputs, backend="reference")
    assert got.shape == (2, h, 1, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("lam_per_head", [False, True], ids=["lam0d", "lam-per-head"])
def test_packed_decode_matches_reference(h, hkv, lam_per_head):
    """The model's interleaved layout: sub-heads 2h, 2h+1 of q and 2g, 2g+1 of k."""
    q1, q2, k1, k2, v, lam = single_query_inputs(2, h, hkv, 29, 16, lam_per_head=lam_per_head)
    q = torch.stack([q1, q2], dim=2).flatten(1, 2)  # (B, 2H, 1, d)
    k = torch.stack([k1, k2], dim=2).flatten(1, 2)  # (B, 2Hkv, S, d)
    mask = torch.ones(2, 1, 1, 29, dtype=torch.bool)
    mask[1, ..., :4] = False
    got = decode_diff_attention_packed(q, k, v, lam, attn_mask=mask)
    want = diff_attention(q1, q2, k1, k2, v, lam, attn_mask=mask, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_with_padding_mask_matches_reference():
    inputs = single_query_inputs(2, 4, 2, 12, 16, lam_per_head=True)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., :5] = False  # row 0 was left-padded by 5 tokens
    got = diff_attention(*inputs, attn_mask=mask, backend="decode")
    want = diff_attention(*inputs, attn_mask=mask, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_gradients_match_reference():
    inputs = [x.requires_grad_() for x in single_query_inputs(1, 4, 2, 20, 16, lam_per_head=True)]
    grads = {}
    for backend in ("decode", "reference"):
        out = diff_attention(*inputs, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), inputs)
    for got, want in zip(grads["decode"], grads["reference"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_rejects_several_queries():
    q1, q2, k1, k2, v, lam = single_query_inputs(1, 2, 2, 8, 16, lam_per_head=False)
    with pytest.raises(ValueError, match="one query per sequence"):
        diff_attention(torch.cat([q1, q1], 2), torch.cat([q2, q2], 2), k1, k2, v, lam, backend="decode")


def test_auto_uses_decode_for_a_single_query():
    assert resolve_backend("auto", torch.device("cpu"), queries=1) == "decode"
    assert resolve_backend("auto", torch.device("cpu"), queries=2) == "sdpa_split"


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["mha", "gqa"])
def test_token_by_token_decoding_gives_full_forward_logits(n_kv_heads):
    """Feeding a sequence one token at a time through the KV cache with backend "decode" gives
    the logits of one full forward with the reference backend."""
    config = ModelConfig.from_preset("debug", attention="diff", n_kv_heads=n_kv_heads)
    model = LanguageModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 14))
    with torch.no_grad():
        model.set_attention_backend("reference")
        full, _ = model(tokens)
        model.set_attention_backend("decode")
        cache = model.new_cache(2, 14)
        steps = [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # decodes token by token (3 s)
def test_auto_generation_runs_decode_steps_and_matches_reference(monkeypatch):
    """generate() with "auto": the prompt goes through "sdpa_split", every later step through
    the packed decode path; the greedy tokens equal those of the reference backend."""
    from diff_transformer import ops as ops_module

    calls = {"decode": 0}
    decode = ops_module.decode_diff_attention_packed

    def counting_decode(*args, **kwargs):
        calls["decode"] += 1
        return decode(*args, **kwargs)

    config = ModelConfig.from_preset("debug", attention="diff")
    model = LanguageModel(config)
    prompts = [[5, 9, 2, 7], [3, 1]]  # different lengths: left padding, masked during decoding
    model.set_attention_backend("reference")
    want = model.generate(prompts, 6, temperature=0.0)
    model.set_attention_backend("auto")
    monkeypatch.setattr(ops_module, "decode_diff_attention_packed", counting_decode)
    got = model.generate(prompts, 6, temperature=0.0)
    assert got == want
    assert calls["decode"] >= 5 * config.n_layers  # every layer, at every step after the prompt
    assert calls["decode"] % config.n_layers == 0


def test_decoding_computes_each_layers_constants_once_per_cache(monkeypatch):
    """Without gradients, λ and the scaled head-norm weight of a layer are computed at its first
    call on a cache and reused at every later step; a new cache computes them from the current
    weights; with gradients they are computed at every call, so that they reach the λ vectors."""
    from diff_transformer.attention import DiffAttention

    counts = {"lam": 0, "norm": 0}
    lam, norm = DiffAttention.lam, DiffAttention._scaled_norm_weight

    def counting(name, original):
        def wrapped(self):
            counts[name] += 1
            return original(self)

        return wrapped

    monkeypatch.setattr(DiffAttention, "lam", counting("lam", lam))
    monkeypatch.setattr(DiffAttention, "_scaled_norm_weight", counting("norm", norm))
    config = ModelConfig.from_preset("debug", attention="diff")
    model = LanguageModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 6))

    def token_by_token():
        cache = model.new_cache(2, 6)
        return torch.cat([model(tokens[:, i : i + 1], cache=cache)[0] for i in range(6)], dim=1)

    with torch.no_grad():
        token_by_token()
        assert counts == {"lam": config.n_layers, "norm": config.n_layers}
        model.layers[0].attn.lambda_q1.add_(0.5)  # new weights between two generations
        model.layers[0].attn.head_norm.weight.mul_(1.5)
        got = token_by_token()
        assert counts == {"lam": 2 * config.n_layers, "norm": 2 * config.n_layers}
        full, _ = model(tokens)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)

    before = counts["lam"]
    cache = model.new_cache(2, 6)
    model(tokens[:, :3], cache=cache)[0].sum().backward()
    assert counts["lam"] == before + config.n_layers and not cache.constants
    assert model.layers[0].attn.lambda_q1.grad is not None and model.layers[0].attn.head_norm.weight.grad is not None
