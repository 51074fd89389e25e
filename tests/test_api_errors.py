"""Bad arguments at the boundary of the Python API (LanguageModel.forward, generate / stream,
diff_attention / reference_diff_attention) are a TypeError or ValueError whose message names the
argument and the value, raised before any computation, never an error from deep inside torch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from diff_transformer.config import ModelConfig
from diff_transformer.generation import generate, stream
from diff_transformer.model import LanguageModel
from diff_transformer.ops import diff_attention, reference_diff_attention

VOCAB = 257


@pytest.fixture(scope="module")
def model() -> LanguageModel:
    return LanguageModel(ModelConfig.from_preset("debug", vocab_size=VOCAB)).eval()


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape)


# --- LanguageModel.forward -------------------------------------------------------------------------


def _with(tensor: torch.Tensor, index: tuple, value: int) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


FORWARD_CASES = [  # (id, tokens, targets, error type, message)
    ("id-too-large", lambda: _with(ids(2, 8), (1, 3), VOCAB), None, ValueError,
     f"tokens: id {VOCAB} is out of range [0, vocab_size={VOCAB})"),
    ("id-negative", lambda: _with(ids(2, 8), (0, 0), -1), None, ValueError,
     f"tokens: id -1 is out of range [0, vocab_size={VOCAB})"),
    ("float-tokens", lambda: ids(2, 8).float(), None, TypeError,
     "tokens must hold integer token ids (torch.long), got dtype torch.float32"),
    ("list-tokens", lambda: [[1, 2, 3]], None, TypeError, "tokens must be a (batch, length) tensor of token ids, got list"),
    ("one-dimensional", lambda: ids(8), None, ValueError, "tokens must be (batch, length) with at least one token, got shape (8,)"),
    ("empty-sequence", lambda: ids(2, 0), None, ValueError, "with at least one token, got shape (2, 0)"),
    ("empty-batch", lambda: ids(0, 8), None, ValueError, "with at least one token, got shape (0, 8)"),
    ("targets-length", lambda: ids(2, 8), lambda: ids(2, 7), ValueError,
     "targets must have the shape of tokens (2, 8), got (2, 7)"),
    ("targets-batch", lambda: ids(2, 8), lambda: ids(16), ValueError, "targets must have the shape of tokens (2, 8), got (16,)"),
    ("targets-float", lambda: ids(2, 8), lambda: ids(2, 8).float(), TypeError, "targets must hold integer token ids"),
    ("target-too-large", lambda: ids(2, 8), lambda: _with(ids(2, 8), (0, 5), 1000), ValueError,
     f"targets: id 1000 is out of range [0, vocab_size={VOCAB}) and is not -100 (ignored)"),
    ("target-negative", lambda: ids(2, 8), lambda: _with(ids(2, 8), (1, 1), -5), ValueError,
     "targets: id -5 is out of range"),
]


@pytest.mark.parametrize("tokens, targets, kind, message", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_names_the_bad_argument_and_its_value(model, tokens, targets, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        model(tokens(), None if targets is None else targets())


def test_forward_accepts_ignored_targets_and_every_valid_id(model):
    tokens = torch.tensor([[0, VOCAB - 1, 5]])
    targets = torch.tensor([[-100, VOCAB - 1, 0]])
    logits, loss = model(tokens, targets)
    assert logits.shape == (1, 3, VOCAB) and torch.isfinite(loss)
    model(tokens.int())  # int32 ids are ids too


def test_check_ids_false_skips_only_the_id_range(model):
    """Decoding steps feed back ids the model sampled: their range check is skipped, the shape's is not."""
    model(ids(1, 1), check_ids=False)
    with pytest.raises(ValueError, match="with at least one token"):
        model(ids(1, 0), check_ids=False)


# --- generate / stream -------------------------------------------------------------------------------

GENERATE_CASES = [  # (id, prompts, keyword arguments, error type, message)
    ("tensor-prompt", lambda: torch.tensor([[1, 2, 3]]), {}, TypeError,
     "prompts must be a list of token-id lists, got a tensor of shape (1, 3); pass tensor.tolist()"),
    ("flat-list", lambda: [1, 2, 3], {}, TypeError,
     "prompts[0] is the integer 1: prompts is a list of prompts, each a list of token ids, e.g. [[1, 2, 3]]"),
    ("string", lambda: "hello", {}, TypeError,
     "prompts must be a list of token-id lists, got a str; encode the text first"),
    ("string-rows", lambda: ["hello"], {}, TypeError, "prompts[0] must be a list of token ids, got str"),
    ("numpy-array", lambda: np.array([[1, 2, 3]]), {}, TypeError,
     "prompts must be a list of token-id lists, got an array of shape (1, 3); pass array.tolist()"),
    ("tensor-rows", lambda: [torch.tensor([1, 2])], {}, TypeError,
     "prompts[0] must be a list of token ids, got Tensor; pass .tolist()"),
    ("no-prompts", lambda: [], {}, ValueError, "prompts must be a non-empty list of token-id lists, got []"),
    ("empty-prompt", lambda: [[1, 2], []], {}, ValueError, "prompts[1] is empty"),
    ("id-too-large", lambda: [[1, VOCAB]], {}, ValueError, f"prompts[0][1] = {VOCAB} is not a token id in [0, vocab_size={VOCAB})"),
    ("id-negative", lambda: [[-3]], {}, ValueError, "prompts[0][0] = -3 is not a token id"),
    ("id-float", lambda: [[1.0]], {}, ValueError, "prompts[0][0] = 1.0 is not a token id"),
    ("max-new-tokens-negative", lambda: [[1]], {"max_new_tokens": -1}, ValueError,
     "max_new_tokens must be an integer >= 0, got -1"),
    ("max-new-tokens-float", lambda: [[1]], {"max_new_tokens": 2.5}, ValueError, "max_new_tokens must be an integer >= 0, got 2.5"),
    ("temperature-nan", lambda: [[1]], {"temperature": float("nan")}, ValueError,
     "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("temperature-negative", lambda: [[1]], {"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
    ("top-k", lambda: [[1]], {"top_k": 0}, ValueError, "top_k must be an integer >= 1 or None, got 0"),
    ("top-p", lambda: [[1]], {"top_p": 1.5}, ValueError, "top_p must be a number in (0, 1] or None, got 1.5"),
    ("stop-tokens-int", lambda: [[1]], {"stop_tokens": 2}, TypeError,
     "stop_tokens must be a list of token ids, e.g. [eos_id], got 2"),
    ("stop-tokens-string", lambda: [[1]], {"stop_tokens": "\n"}, TypeError, "stop_tokens must be a list of token ids"),
    ("stop-token-range", lambda: [[1]], {"stop_tokens": [VOCAB + 4]}, ValueError,
     f"stop_tokens: {VOCAB + 4} is not a token id in [0, vocab_size={VOCAB})"),
]


@pytest.mark.parametrize("prompts, options, kind, message", [c[1:] for c in GENERATE_CASES],
                         ids=[c[0] for c in GENERATE_CASES])
def test_generate_and_stream_name_the_bad_argument_and_its_value(model, prompts, options, kind, message):
    options = {"max_new_tokens": 2, **options}
    with pytest.raises(kind, match=re.escape(message)):
        generate(model, prompts(), **options)
    with pytest.raises(kind, match=re.escape(message)):
        next(stream(model, prompts(), **options))


def test_generate_with_good_arguments_still_runs(model):
    out = generate(model, [[1, 2], (3,)], 3, temperature=0.0, stop_tokens=iter([VOCAB - 1]))
    assert len(out) == 2 and all(len(row) <= 3 for row in out)
    assert generate(model, [[1]], 0) == [[]]  # nothing to generate: no work, no tokens


def test_numpy_integers_are_token_ids_and_counts(model):
    """Ids as NumPy integers (a tokenizer's or an array's rows) are ids, as Python ints are."""
    expected = generate(model, [[1, 2]], 3, temperature=0.0)
    assert generate(model, [[np.int64(1), np.int32(2)]], np.int64(3), temperature=np.float32(0)) == expected
    assert generate(model, [[1, 2]], 3, temperature=0.0, stop_tokens=np.array([expected[0][0]])) == [[]]


# --- diff_attention / reference_diff_attention ------------------------------------------------------


def _inputs(v_width: int = 16, t: int = 5):
    b, h, d = 2, 2, 8
    q1, q2, k1, k2 = (torch.randn(b, h, t, d) for _ in range(4))
    v = torch.randn(b, h, t, v_width)
    return q1, q2, k1, k2, v, torch.tensor(0.3)


@pytest.mark.parametrize("op", [lambda *a: diff_attention(*a, backend="math"), lambda *a: reference_diff_attention(*a)],
                         ids=["diff_attention", "reference_diff_attention"])
def test_the_reference_checks_its_inputs_as_the_fast_op_does(op):
    message = "v must be (B, Hkv, S, 2d) = (2, 2, 5, 16) (or (B, Hkv, S, d) = (2, 2, 5, 8)), got (2, 2, 5, 12)"
    with pytest.raises(ValueError, match=re.escape(message)):
        op(*_inputs(v_width=12))
    with pytest.raises(ValueError, match=re.escape("q1 has 0 queries and k1 0 keys: both need at least one")):
        op(*_inputs(t=0))
    q1, q2, k1, k2, v, lam = _inputs()
    with pytest.raises(TypeError, match="k2 must be floating point, got torch.int64"):
        op(q1, q2, k1, k2.long(), v, lam)
    with pytest.raises(TypeError, match="lam must be a floating-point tensor, 0-d or \\(H,\\), got float"):
        op(q1, q2, k1, k2, v, 0.3)
