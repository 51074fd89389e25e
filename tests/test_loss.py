"""The fused LM head + cross-entropy against F.cross_entropy on the whole logits, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diff_transformer.config import ModelConfig
from diff_transformer.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy
from diff_transformer.model import LanguageModel


def plain(hidden, weight, targets, reduction):
    return F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def inputs(n=37, e=16, v=50, ignored=(0, 5, 36)):
    hidden = torch.randn(n, e, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, e, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    targets[list(ignored)] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", [1, 8, 37, 64], ids=lambda r: f"rows{r}")
def test_matches_cross_entropy_of_the_whole_logits(reduction, rows):
    """Chunks of 1 row, several with a short last one, exactly one, and one larger than N."""
    hidden, weight, targets = inputs()
    got = linear_cross_entropy(hidden, weight, targets, reduction=reduction, rows=rows)
    want = plain(hidden, weight, targets, reduction)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got_grads = torch.autograd.grad(got * 1.7, (hidden, weight))  # a non-unit upstream gradient
    want_grads = torch.autograd.grad(want * 1.7, (hidden, weight))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_a_hand_worked_case():
    """Two tokens, two words, weight = identity: logits = hidden. Token 0 scores (0, ln 3) and
    targets word 1: loss −ln(3/4); token 1 is ignored. d loss/d hidden_0 = softmax − onehot."""
    hidden = torch.tensor([[0.0, math.log(3.0)], [5.0, -2.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.eye(2, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([1, IGNORE_INDEX])
    loss = linear_cross_entropy(hidden, weight, targets, rows=1)
    assert loss.item() == pytest.approx(-math.log(0.75), abs=1e-7)
    loss.backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[0.25, -0.25], [0.0, 0.0]], dtype=torch.float64))
    # d/dW[v, e] = Σ_n (softmax − onehot)[n, v] · hidden[n, e], token 0 only
    want = torch.tensor([[0.25 * 0.0, 0.25 * math.log(3.0)], [-0.25 * 0.0, -0.25 * math.log(3.0)]], dtype=torch.float64)
    torch.testing.assert_close(weight.grad, want)


def test_without_gradients_computes_the_loss_only():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, targets, rows=8)
    torch.testing.assert_close(got, plain(hidden, weight, targets, "mean").detach())
    assert not got.requires_grad


def test_a_frozen_head_gets_no_gradient():
    hidden, weight, targets = inputs()
    weight.requires_grad_(False)
    got = linear_cross_entropy(hidden, weight, targets, rows=8)
    (grad,) = torch.autograd.grad(got, hidden)
    (want,) = torch.autograd.grad(plain(hidden, weight, targets, "mean"), hidden)
    torch.testing.assert_close(grad, want)


def test_nothing_counted_gives_nan_mean_and_zero_sum():
    hidden, weight, _ = inputs()
    none = torch.full((hidden.shape[0],), IGNORE_INDEX)
    assert math.isnan(linear_cross_entropy(hidden, weight, none).item())
    assert linear_cross_entropy(hidden, weight, none, reduction="sum").item() == 0.0


def test_bad_shapes_and_reduction_are_named():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="share E"):
        linear_cross_entropy(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(hidden, weight, targets[:4])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="none")


def test_chunk_rows_by_hand():
    cpu = torch.device("cpu")
    assert chunk_rows(8192, cpu) == 256  # 8 MiB / (4 B · 8,192 words)
    assert chunk_rows(100_288, cpu) == 32  # 20 rows fit; the floor is 32
    assert chunk_rows(512, cpu) == 4096


@pytest.mark.parametrize("tie", [False, True], ids=["own-head", "tied"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_model_without_logits_matches_the_model_with_them(tie, reduction):
    """model(tokens, targets, return_logits=False) gives the loss and every parameter's gradient
    of the plain path (the tied case adds the head's gradient into the embedding's)."""
    config = ModelConfig.from_preset("debug", attention="diff", tie_embeddings=tie)
    model = LanguageModel(config)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    results = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        logits, loss = model(tokens, targets, return_logits=not fused, reduction=reduction)
        assert (logits is None) == fused
        loss.backward()
        results[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)  # fp32, |grad| <= ~5
