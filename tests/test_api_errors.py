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
    ("list-tokens", lambda: [[1, 2, 3]], None, TypeError,
     "tokens must be a (batch, length) tensor of token ids, got list"),
    ("one-dimensional", lambda: ids(8), None, ValueError,
     "tokens must be (batch, length) with at least one token, got shape (8,)"),
    ("empty-sequence", lambda: ids(2, 0), None, ValueError, "with at least one token, got shape (2, 0)"),
    ("empty-batch", lambda: ids(0, 8), None, ValueError, "with at least one token, got shape (0, 8)"),
    ("targets-length", lambda: ids(2, 8), lambda: ids(2, 7), ValueError,
     "targets must have the shape of tokens (2, 8), got (2, 7)"),
    ("targets-batch", lambda: ids(2, 8), lambda: ids(16), ValueError,
     "targets must have the shape of tokens (2, 8), got (16,)"),
    ("targets-float", lambda: ids(2, 8), lambda: ids(2, 8).float(), TypeError, "targets must hold integer token ids"),
    ("target-too-large", lambda: ids(2, 8), lambda: _with(ids(2, 8), (0, 5), 1000), ValueError,
     f"targets: id 1000 is out of range [0, vocab_size={VOCAB}) and is not -100 (ignored)"),
    ("target-negative", lambda: ids(2, 8), lambda: _with(ids(2, 8), (1, 1), -5), ValueError,
     "targets: id -5 is out of range"),
]


@pytest.mark.parametrize("tokens, targets, kind, message", [c[1:] for c in FORWARD_CASES],
                         ids=[c[0] for c in FORWARD_CASES])
def test_forward_names_the_bad_argument_and_its_value(model, tokens, targets, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        model(tokens(), None if targets is None else targets())


@pytest.mark.parametrize("argument", ["tokens", "targets", "document_ids", "padding_mask"])
def test_a_tensor_on_another_device_is_named(model, argument):
    """torch's "Expected all tensors to be on the same device" comes from deep inside and names none;
    the meta device stands in for another one on a machine without a GPU."""
    tokens = ids(2, 8)
    given = {"targets": ids(2, 8), "document_ids": torch.zeros(2, 8, dtype=torch.long),
             "padding_mask": torch.ones(2, 8, dtype=torch.bool)}
    given = {argument: given[argument]} if argument != "tokens" else {}
    if argument == "tokens":
        tokens = tokens.to("meta")
    else:
        given[argument] = given[argument].to("meta")
    whose = "the model's" if argument == "tokens" else "the tokens'"
    with pytest.raises(ValueError, match=f"^{argument} is on meta, {whose} device is cpu: move it there"):
        model(tokens, **given)


@pytest.mark.parametrize("document_ids, message", [
    (torch.zeros(2, 7, dtype=torch.long), r"document_ids must be integers of the tokens' shape \(2, 8\), got "
                                          r"torch.int64 \(2, 7\)"),
    (torch.zeros(2, 8), r"got torch.float32 \(2, 8\)"),
])
def test_document_ids_of_another_shape_or_dtype_are_named(model, document_ids, message):
    with pytest.raises(ValueError, match=message):
        model(ids(2, 8), document_ids=document_ids)


def test_forward_accepts_ignored_targets_and_every_valid_id(model):
    tokens = torch.tensor([[0, VOCAB - 1, 5]])
    targets = torch.tensor([[-100, VOCAB - 1, 0]])
    logits, loss = model(tokens, targets)
    assert logits.shape == (1, 3, VOCAB) and torch.isfinite(loss)
    model(tokens.int())  # int32 ids are ids too


def test_every_target_ignored_is_refused_for_a_mean(model):
    """The mean over no counted targets is 0/0: a ValueError on both loss paths, not a NaN loss."""
    tokens, ignored = ids(2, 8), torch.full((2, 8), -100)
    for return_logits in (True, False):
        with pytest.raises(ValueError, match=re.escape("targets: every target is -100 (ignored), so the mean loss")):
            model(tokens, ignored, return_logits=return_logits)
        assert model(tokens, ignored, reduction="sum", return_logits=return_logits)[1].item() == 0.0
    one = ignored.clone()
    one[1, 3] = 7
    assert torch.isfinite(model(tokens, one)[1])


def test_reduction_is_checked_before_any_work(model):
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none' .*, got 'avg'"):
        model(ids(2, 8), ids(2, 8), reduction="avg")
    with pytest.raises(ValueError, match="got 'none' with return_logits=False"):
        model(ids(2, 8), ids(2, 8), reduction="none", return_logits=False)
    assert model(ids(2, 8), ids(2, 8), reduction="none")[1].shape == (16,)  # a loss per target


@pytest.mark.parametrize("batch, length, message", [
    (0, None, "batch_size of a KV cache must be a positive integer, got 0"),
    (1, 1000, "a KV cache of 1000 tokens exceeds max_seq_len=128"),
    (1, 2.5, "max_len of a KV cache must be a positive integer, got 2.5"),
], ids=["no-rows", "beyond-context", "fractional"])
def test_new_cache_checks_its_size(model, batch, length, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model.new_cache(batch, length)


def test_a_cache_of_another_dtype_is_a_type_error(model):
    cache = model.new_cache(1)
    half = LanguageModel(ModelConfig.from_preset("debug", vocab_size=VOCAB)).to(torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape("cache holds torch.float32 keys and values, the model computes in "
                                                  "torch.bfloat16: make the cache after converting the model")):
        half(ids(1, 3), cache=cache)


@pytest.mark.parametrize("config, hint", [
    ("debug", "pass ModelConfig.from_preset('debug')"),
    ({"d_model": 64}, "pass ModelConfig.from_dict(...)"),
    (None, "pass ModelConfig(...) or ModelConfig.from_preset(...)"),
], ids=["preset-name", "dict", "none"])
def test_language_model_wants_a_model_config(config, hint):
    with pytest.raises(TypeError, match=re.escape(f"config must be a ModelConfig, got {type(config).__name__} "
                                                  f"{config!r}; {hint}")):
        LanguageModel(config)


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
    ("id-too-large", lambda: [[1, VOCAB]], {}, ValueError,
     f"prompts[0][1] = {VOCAB} is not a token id in [0, vocab_size={VOCAB})"),
    ("id-negative", lambda: [[-3]], {}, ValueError, "prompts[0][0] = -3 is not a token id"),
    ("id-float", lambda: [[1.0]], {}, ValueError, "prompts[0][0] = 1.0 is not a token id"),
    ("max-new-tokens-negative", lambda: [[1]], {"max_new_tokens": -1}, ValueError,
     "max_new_tokens must be an integer >= 0, got -1"),
    ("max-new-tokens-float", lambda: [[1]], {"max_new_tokens": 2.5}, ValueError,
     "max_new_tokens must be an integer >= 0, got 2.5"),
    ("temperature-nan", lambda: [[1]], {"temperature": float("nan")}, ValueError,
     "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("temperature-negative", lambda: [[1]], {"temperature": -0.5}, ValueError,
     "temperature must be a finite number >= 0"),
    ("top-k", lambda: [[1]], {"top_k": 0}, ValueError, "top_k must be an integer >= 1 or None, got 0"),
    ("top-p", lambda: [[1]], {"top_p": 1.5}, ValueError, "top_p must be a number in (0, 1] or None, got 1.5"),
    ("stop-tokens-int", lambda: [[1]], {"stop_tokens": 2}, TypeError,
     "stop_tokens must be a list of token ids, e.g. [eos_id], got 2"),
    ("stop-tokens-string", lambda: [[1]], {"stop_tokens": "\n"}, TypeError, "stop_tokens must be a list of token ids"),
    ("stop-token-range", lambda: [[1]], {"stop_tokens": [VOCAB + 4]}, ValueError,
     f"stop_tokens: {VOCAB + 4} is not a token id in [0, vocab_size={VOCAB})"),
    ("beyond-context", lambda: [[1] * 100, [2]], {"max_new_tokens": 40}, ValueError,
     "prompt (100 tokens) + max_new_tokens (40) exceeds max_seq_len=128, the model's context: at most 28 new "
     "tokens fit after this prompt"),
]


@pytest.mark.parametrize("prompts, options, kind, message", [c[1:] for c in GENERATE_CASES],
                         ids=[c[0] for c in GENERATE_CASES])
def test_generate_and_stream_name_the_bad_argument_and_its_value(model, prompts, options, kind, message):
    options = {"max_new_tokens": 2, **options}
    with pytest.raises(kind, match=re.escape(message)):
        generate(model, prompts(), **options)
    with pytest.raises(kind, match=re.escape(message)):
        next(stream(model, prompts(), **options))


def test_stream_checks_its_arguments_when_called(model):
    """Not at its first step: the refusal comes before any work, where the call is."""
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        stream(model, [[1] * 100], 40)
    assert len(list(stream(model, [[1] * 100], 28, temperature=0.0))) == 28  # what fits, fits


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


# --- MultiheadDiffAttention: masks and dtypes -------------------------------------------------------


@pytest.mark.parametrize("causal, make_mask, where", [
    (False, lambda: torch.ones(3, 5, dtype=torch.bool).index_fill_(0, torch.tensor([1]), False)[:, None, None, :],
     "batch 1, query 0"),  # a fully padded sequence: every query of it is blind; the first named
    (False, lambda: torch.ones(5, 5, dtype=torch.bool).index_fill_(0, torch.tensor([2]), False), "query 2"),
    (True, lambda: torch.ones(3, 5, dtype=torch.bool).index_fill_(1, torch.tensor([0]), False)[:, None, None, :],
     "batch 0, query 0 (with the causal mask)"),  # key 0 hidden: causal query 0 sees nothing else
    (True, lambda: torch.ones(3, 2, 5, 5, dtype=torch.bool).index_put_(
        (torch.tensor(2), torch.tensor(1), torch.tensor(3)), torch.tensor(False)),
     "batch 2, head 1, query 3"),
], ids=["padded-row", "2d", "causal-first-key", "per-head"])
def test_a_mask_that_hides_every_key_of_a_query_is_refused(causal, make_mask, where):
    from diff_transformer import MultiheadDiffAttention

    attn = MultiheadDiffAttention(64, 2, causal=causal)
    with pytest.raises(ValueError, match=re.escape(f"attn_mask hides every key from {where}")):
        attn(torch.randn(3, 5, 64), make_mask())
    q1, q2, k1, k2 = (torch.randn(3, 2, 5, 16) for _ in range(4))
    with pytest.raises(ValueError, match=re.escape(f"attn_mask hides every key from {where}")):
        diff_attention(q1, q2, k1, k2, torch.randn(3, 2, 5, 32), torch.tensor(0.5), causal=causal,
                       attn_mask=make_mask())


def test_a_mask_that_leaves_a_key_to_every_query_runs():
    from diff_transformer import MultiheadDiffAttention

    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 3:] = False  # right padding: the causal queries of the padding still see the real keys
    out = MultiheadDiffAttention(64, 2)(torch.randn(3, 5, 64), keep[:, None, None, :])
    assert torch.isfinite(out).all()


def test_an_input_of_another_dtype_than_the_module_is_a_type_error():
    from diff_transformer import MultiheadDiffAttention

    attn = MultiheadDiffAttention(64, 2)
    with pytest.raises(TypeError, match=re.escape("x is torch.float64 but the module's weights are torch.float32: "
                                                  "convert one of them, x.to(torch.float32) or "
                                                  "module.to(torch.float64)")):
        attn(torch.randn(2, 5, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match=re.escape("x is torch.int64 but the module's weights are torch.float32")):
        attn(torch.ones(2, 5, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="x must be a \\(batch, length, embed_dim\\) tensor, got list"):
        attn([[0.0] * 64])
    with pytest.raises(ValueError, match=re.escape("x must be (batch, length, embed_dim=64) with at least one "
                                                   "position, got (2, 0, 64)")):
        attn(torch.randn(2, 0, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the input itself
        assert attn(torch.randn(2, 5, 64, dtype=torch.bfloat16)).shape == (2, 5, 64)
