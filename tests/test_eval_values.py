"""Known-answer tests for every evaluation of the suite.

Each test feeds an evaluation hand-built inputs (tensors, documents, or a stand-in model whose
outputs are planted) and compares what comes out with a value worked out by hand or by a few
lines of independent oracle code here, never with the code under test. Together they pin each
step of each measurement: which attention map (DIFF's p1 − λ·p2, DIFF V2's combination, the
softmax map), which layers, heads, query rows and key columns, which tensor (pre-softmax logits,
block outputs), which tokens are scored, how quantisation treats both of DIFF's logit maps,
position-NLL's cumulative average and the scaling fit. docs/evaluation.md lists which test pins
which evaluation.
"""

from __future__ import annotations

import math
import random
import re
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.attention import apply_rope, rope_frequencies
from diff_transformer.data.synthetic import ICL_WORDS, ClassificationTask, mqar_vocabulary
from diff_transformer.evaluation import EvalText, ModelUnderTest
from diff_transformer.evaluation import (
    ar_hit,
    attention_noise,
    attention_sink,
    icl,
    mqar,
    needle,
    outliers,
    position_nll,
    quantization,
    scaling,
)
from diff_transformer.evaluation.scoring import score_choices, score_sequences
from diff_transformer.ops import AttentionMaps
from diff_transformer.tokenizer import ByteTokenizer

TOK = ByteTokenizer()  # one token per byte, so token positions are character positions
TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=6000))])
V = TOK.vocab_size  # 257


# --- stand-ins and oracles ----------------------------------------------------------------------


class FakeModel(nn.Module):
    """What the evaluations use of a LanguageModel, with planted outputs.

    ``next_logits(tokens (B, T)) -> (B, T, V)`` replaces the forward pass; ``maps(tokens, layer)``
    (optional) gives each layer's effective attention map, handed to a tap as AttentionMaps;
    ``decode(prompt, n) -> new tokens`` replaces greedy decoding.
    """

    def __init__(self, next_logits=None, *, n_layers=1, max_seq_len=256, maps=None, decode=None):
        super().__init__()
        self.embed = nn.Embedding(1, 1)  # only its device is read
        self.config = SimpleNamespace(max_seq_len=max_seq_len, n_layers=n_layers, attention="standard", vocab_size=V,
                                      rope_theta=10_000.0)
        self.next_logits, self.maps, self.decode = next_logits, maps, decode
        self.tap = None

    def forward(self, tokens, targets=None, *, cache=None, padding_mask=None, logits_to_keep=0):
        assert cache is None, "the stand-in has no KV cache"
        if self.tap is not None:
            for layer in range(self.config.n_layers):
                combined = self.maps(tokens, layer)
                uniform = torch.ones_like(combined).tril() / torch.arange(1, combined.shape[-1] + 1)[:, None]
                # probs deliberately differ from combined: an evaluation reading probs[0] gets other numbers
                self.tap.record(layer, AttentionMaps(logits=(), probs=(uniform, uniform), combined=combined))
            return None, None
        return self.next_logits(tokens), None

    def generate(self, prompts, max_new_tokens, **sampling):
        assert sampling.get("temperature") == 0.0  # greedy
        return [self.decode(list(p), max_new_tokens) for p in prompts]

    def lambdas(self):
        return []

    def num_parameters(self, **_):
        return 0

    @contextmanager
    def tap_attention(self, tap):
        self.tap = tap
        try:
            yield tap
        finally:
            self.tap = None


def bigram_table(seed=0):
    """A fixed random next-token table: the stand-in's logits at t depend on tokens[t] only."""
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2


def bigram_nll(table, windows):
    """Oracle NLL (N, T) of windows (N, T + 1) under the bigram table, one token at a time."""
    out = torch.zeros(windows.shape[0], windows.shape[1] - 1)
    for n in range(windows.shape[0]):
        for t in range(windows.shape[1] - 1):
            logp = table[windows[n, t]].log_softmax(-1)
            out[n, t] = -logp[windows[n, t + 1]]
    return out


def chars(tokens):
    """Token ids as a string of the same length (eos shown as '#')."""
    return "".join(chr(t) if t < 256 else "#" for t in tokens)


def one_hot_logits(next_ids, scale=20.0):
    """(B, T) predicted ids -> (B, T, V) logits whose argmax they are."""
    return F.one_hot(next_ids, V).float() * scale


def tiny(kind, n_layers=2, seed=0, **overrides):
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig.from_preset("debug", attention=kind, n_layers=n_layers, **overrides)).eval()


def oracle_logits(layer, h, rope):
    """Pre-softmax logits of one attention layer from its projections, as a list of (B, heads, T, T)
    maps: [q1·k1, q2·k2] for DIFF (sub-heads 2h, 2h+1), [q·k] over all query heads otherwise."""
    attn = layer.attn
    b, t, _ = h.shape
    d = attn.head_dim
    q = apply_rope(attn.q_proj(h).view(b, t, -1, d), rope).transpose(1, 2).float()  # (B, nq, T, d)
    k = apply_rope(attn.k_proj(h).view(b, t, -1, d), rope).transpose(1, 2).float()  # (B, nk, T, d)
    if layer.attn.config.attention == "diff":
        pairs = [(q[:, 0::2], k[:, 0::2]), (q[:, 1::2], k[:, 1::2])]
    else:
        pairs = [(q, k)]
    maps = []
    for qq, kk in pairs:
        kk = kk.repeat_interleave(qq.shape[1] // kk.shape[1], dim=1)  # query head h reads kv head h // n_rep
        maps.append(qq @ kk.transpose(-1, -2) / math.sqrt(d))
    return maps


def oracle_forward(model, tokens):
    """(per-layer logit maps, per-layer block outputs) of a LanguageModel, layer by layer."""
    rope = rope_frequencies(torch.arange(tokens.shape[1]), model.config.head_dim, model.config.rope_theta)
    x = model.embed(tokens)
    logits, hidden = [], []
    for layer in model.layers:
        logits.append(oracle_logits(layer, layer.attn_norm(x), rope))
        x = layer(x, rope, None, None)
        hidden.append(x)
    return logits, hidden


class Recorder(AttentionTap):
    def __init__(self):
        self.maps = {}

    def record(self, layer_index, maps):
        self.maps[layer_index] = maps


# --- the attention tap: which map is "the" map ----------------------------------------------------


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2"])
def test_tap_hands_over_the_logits_and_the_effective_map(kind):
    """logits = q·k/√d of each map (DIFF: both); combined = p (standard), p1 − λ·p2 (DIFF),
    p_2h − σ(x W_λ)_h · p_2h+1 (DIFF V2), all from an oracle on the layer's own projections."""
    model = tiny(kind, n_layers=1)
    tokens = torch.randint(0, V, (2, 12))
    with torch.no_grad(), model.tap_attention(Recorder()) as tap:
        model(tokens)
        maps = tap.maps[0]
        layer = model.layers[0]
        h = layer.attn_norm(model.embed(tokens))
        rope = rope_frequencies(torch.arange(12), model.config.head_dim, model.config.rope_theta)
        expected = oracle_logits(layer, h, rope)
    visible = torch.ones(12, 12, dtype=torch.bool).tril()
    assert len(maps.logits) == len(expected) == (2 if kind == "diff" else 1)
    probs = []
    for got, want in zip(maps.logits, expected):
        torch.testing.assert_close(got[..., visible], want[..., visible], atol=1e-5, rtol=1e-5)
        assert torch.isneginf(got[..., ~visible]).all()
        probs.append(want.masked_fill(~visible, float("-inf")).softmax(-1))
    if kind == "standard":
        want = probs[0]
    elif kind == "diff":
        want = probs[0] - float(layer.attn.lam().detach()) * probs[1]
    else:
        lam = torch.sigmoid(h @ layer.attn.lambda_proj.weight.T).transpose(1, 2)[..., None]  # (B, H, T, 1)
        want = probs[0][:, 0::2] - lam * probs[0][:, 1::2]
    torch.testing.assert_close(maps.combined, want, atol=1e-5, rtol=1e-5)


# --- attention noise ----------------------------------------------------------------------------


def needle_layout(tokens):
    """Oracle reading of a needle document from its text: (answer rows, answer columns, lead-in
    column of the queried needle, first column of the question)."""
    text = chars(tokens)
    question = text.index("\nQuestion:")
    city = re.search(r"magic number of (\w+)\?", text[question:])[1]
    needle_match = re.search(rf" The magic number of {city} is( \d+)\.", text[:question])
    answer_match = re.search(rf"The magic number of {city} is( \d+)\.", text[text.index("Answer:"):])
    a0 = text.index("Answer:") + answer_match.start(1)
    rows = list(range(a0 - 1, a0 + len(answer_match[1]) - 1))  # the positions that predict the answer tokens
    columns = list(range(*needle_match.span(1)))  # " NNNN" inside the needle sentence
    return rows, columns, needle_match.start(), question


def planted_noise_maps(tokens, layer):
    """Three layers of planted maps (B, 2 heads, T, T) for the attention-noise evaluation.

    Answer rows: layer 0 head 0 spreads over the answer columns, head 1 sits on column 0 (noise),
    the whole map scaled by 0.7 as a DIFF map (row sum 1 − λ); layer 1 has row sums 0.02 (λ = 0.98:
    left out); layer 2 puts head 0 on the question and head 1 on the needle's lead-in (other).
    Every other row attends to itself only."""
    b, t = tokens.shape
    maps = torch.eye(t).expand(b, 2, t, t).clone()
    for i in range(b):
        rows, columns, lead, question = needle_layout(tokens[i].tolist())
        for r in rows:
            maps[i, :, r] = 0
            if layer == 0:
                maps[i, 0, r, columns] = 1 / len(columns)
                maps[i, 1, r, 0] = 1.0
            elif layer == 1:
                maps[i, :, r, 0] = 1.0
            else:
                maps[i, 0, r, question] = 1.0
                maps[i, 1, r, lead] = 1.0
    return maps * {0: 0.7, 1: 0.02, 2: 1.0}[layer]


def test_attention_noise_measures_answer_rows_by_column_group_layer_and_head():
    model = FakeModel(n_layers=3, maps=planted_noise_maps)
    options = attention_noise.AttentionNoiseOptions(depths=(0.0, 1.0), samples=2, batch_size=2, length=200)
    result = attention_noise.run(ModelUnderTest("planted", model, TOK), options, TEXT, progress=False)
    # Per kept layer (head mean, rows / row sum): layer 0 answer ½ noise ½; layer 2 other 1.
    for entry in result["by_depth"]:
        assert entry["answer"] == pytest.approx(0.25, abs=1e-6)
        assert entry["noise"] == pytest.approx(0.25, abs=1e-6)
        assert entry["other"] == pytest.approx(0.5, abs=1e-6)
        assert entry["per_layer"]["answer"] == pytest.approx([0.5, 0.0, 0.0], abs=1e-6)
        assert entry["per_layer"]["other"] == pytest.approx([0.0, 0.0, 1.0], abs=1e-6)
        assert entry["layers_left_out"] == [0, 2 * 5, 0]  # 2 documents × 5 answer rows (" NNNN")
    # The profile: the first answer row of one document at the middle depth, mean of layers 0 and 2.
    profile = result["profile"]
    attention = torch.tensor(profile["attention"])
    assert profile["depth"] == 1.0 and len(profile["answer"]) == 5
    assert attention[profile["answer"]].tolist() == pytest.approx([0.05] * 5, abs=1e-6)  # ½ · (0.1 + 0)
    assert float(attention[0]) == pytest.approx(0.25, abs=1e-6)
    assert float(attention[profile["question_start"]]) == pytest.approx(0.25, abs=1e-6)
    assert float(attention.sum()) == pytest.approx(1.0, abs=1e-6)


def test_group_mass_tap_uses_the_combined_map_averaged_over_heads():
    """Hand-built maps, one document, S = 6: columns 0-1 noise, 2-3 answer, 4-5 other."""
    groups = {"noise": torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool),
              "answer": torch.tensor([0, 0, 1, 1, 0, 0], dtype=torch.bool),
              "other": torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool)}
    combined = torch.zeros(1, 2, 6, 6)
    combined[0, 0, 4] = torch.tensor([0.2, 0.0, 0.4, 0.0, 0.0, 0.0])  # row 4, head 0: sum 0.6
    combined[0, 1, 4] = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.3, 0.0])  # row 4, head 1: sum 0.6
    combined[0, :, 5] = 0.01  # row 5: each head sums to 0.06 ...
    combined[0, 1, 5, 0] = -0.04  # ... but head 1 to 0.01: head mean 0.035 < 0.05, left out
    p1 = torch.full_like(combined, 1 / 6)
    tap = attention_noise.GroupMassTap([[4, 5]], [groups], n_layers=1)
    tap.record(0, AttentionMaps(logits=(), probs=(p1, p1), combined=combined))
    # Row 4 head mean: noise 0.1, answer 0.35, other 0.15 over a sum of 0.6.
    assert tap.mass[0].tolist() == pytest.approx([0.35 / 0.6, 0.1 / 0.6, 0.15 / 0.6], abs=1e-6)  # GROUPS order
    assert attention_noise.GROUPS == ("answer", "noise", "other")
    assert int(tap.count[0]) == 1 and tap.left_out == [1]


# --- attention sink ------------------------------------------------------------------------------


def test_first_token_share_of_hand_built_maps():
    """Two windows, two heads, T = 4. Window 0, softmax rows: the head means at key 0 are 1, 0.7, 0.4, 0.4
    over rows summing to 1. Window 1, DIFF-like rows (sums 0.5, entries of either sign): head means
    [0.3, 0.2] (share 0.6) and [0.1, 0.1, 0.3] (share 0.2); row 3 sums to 0.015 < 0.05 and is left out."""
    combined = torch.zeros(2, 2, 4, 4)
    combined[0, :, 0, 0] = 1.0
    combined[0, 0, 1:] = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.6, 0.2, 0.2, 0.0], [0.1, 0.3, 0.3, 0.3]])
    combined[0, 1, 1:] = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.2, 0.4, 0.4, 0.0], [0.7, 0.1, 0.1, 0.1]])
    combined[1, :, 0, 0] = 0.5
    combined[1, 0, 1:] = torch.tensor([[0.4, 0.1, 0.0, 0.0], [0.3, -0.1, 0.3, 0.0], [0.01, 0.0, 0.0, 0.0]])
    combined[1, 1, 1:] = torch.tensor([[0.2, 0.3, 0.0, 0.0], [-0.1, 0.3, 0.3, 0.0], [0.02, 0.0, 0.0, 0.0]])
    shares, left_out = attention_sink.first_token_share(combined)  # queries 1, 2, 3
    assert shares.tolist() == pytest.approx([(0.7 + 0.4 + 0.4) / 3, (0.6 + 0.2) / 2], abs=1e-6) and left_out == 1
    shares, left_out = attention_sink.first_token_share(combined, first_query=0)  # query 0 counts (share 1)
    assert shares.tolist() == pytest.approx([(1 + 0.7 + 0.4 + 0.4) / 4, (1 + 0.6 + 0.2) / 3], abs=1e-6)
    shares, left_out = attention_sink.first_token_share(combined, first_query=3)  # row 3 only
    assert shares[0].item() == pytest.approx(0.4, abs=1e-6) and math.isnan(shares[1].item()) and left_out == 1
    assert attention_sink.uniform_share(4) == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert attention_sink.uniform_share(4, first_query=0) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)


def planted_sink_maps(tokens, layer):
    """Two layers of planted maps (B, 2 heads, T, T). Layer 0, row i >= 1: head 0 puts a = tokens[b, 0] / 512
    on key 0 and 1 − a on key i, head 1 all on key i; the map scaled by 0.7 (a DIFF map, row sum 1 − λ).
    Query 0 attends to key 0. Layer 1: every row sums to 0.02 (λ = 0.98): left out."""
    b, t = tokens.shape
    maps = torch.eye(t).expand(b, 2, t, t).clone()
    a = tokens[:, 0].float() / 512
    maps[:, 0, 1:, 0] = a[:, None]
    maps[:, 0, torch.arange(1, t), torch.arange(1, t)] = 1 - a[:, None]
    return maps * (0.7 if layer == 0 else 0.02)


def test_attention_sink_reads_every_layer_and_window():
    model = FakeModel(n_layers=2, max_seq_len=16, maps=planted_sink_maps)
    seen = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    options = attention_sink.AttentionSinkOptions(windows=6, batch_size=4)
    result = attention_sink.run(ModelUnderTest("planted", model, TOK), options, TEXT, progress=False)
    tokens = torch.cat(seen)  # (6, 16): the windows' inputs, over two forward passes
    assert tokens.shape == (6, 16) and result["windows"] == 6 and result["seq_len"] == 16
    shares = [tokens[b, 0].item() / 512 / 2 for b in range(6)]  # head mean a / 2 over rows summing to 1
    mean = sum(shares) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in shares) / 5)
    assert std > 0.01  # the windows differ
    assert result["per_layer"]["mean"] == pytest.approx([mean, None], abs=1e-6)
    assert result["per_layer"]["std"] == pytest.approx([std, None], abs=1e-6)
    assert result["mean_over_layers"] == pytest.approx({"mean": mean, "std": std}, abs=1e-6)
    assert result["per_window"]["mean_over_layers"] == pytest.approx(shares, abs=1e-6)
    assert result["rows_left_out"] == [0, 6 * 15]  # layer 1: every row of every window but query 0's
    assert result["uniform_share"] == pytest.approx(sum(1 / (i + 1) for i in range(1, 16)) / 15)


# --- needle retrieval ----------------------------------------------------------------------------


def retrieval_oracle(limit=None):
    """Greedy decoding stand-in: after "... The magic number of CITY is" it writes " NNNN." read from
    CITY's needle in the haystack; if ``limit`` is set and that needle starts at or after token
    ``limit``, it writes " NNNN1" (right prefix, one digit too many: exact match must reject it).
    A prompt that does not end with "is" gets "?"."""

    def decode(prompt, n):
        text = chars(prompt)
        question = text.index("\nQuestion:")
        match = re.search(r"The magic number of (\w+) is$", text)
        if match is None:
            return TOK.encode("?")[:n]
        needle_match = re.search(rf" The magic number of {match[1]} is( \d+)\.", text[:question])
        answer = needle_match[1] + ("1" if limit is not None and needle_match.start() >= limit else ".")
        return TOK.encode(answer)[:n]

    return decode


def test_needle_scores_each_query_by_exact_match_of_the_decoded_number():
    perfect = FakeModel(decode=retrieval_oracle(), max_seq_len=256)
    options = needle.NeedleOptions(settings=("1:1", "2:2"), heatmap="2:1", depths=(0.0, 0.5, 1.0),
                                   lengths=(256,), samples=2)
    result = needle.run(ModelUnderTest("perfect", perfect, TOK), options, TEXT, progress=False)
    for setting, r in (("1:1", 1), ("2:2", 2)):
        entry = result["table"][setting]
        assert entry["accuracy"] == 1.0 and entry["by_depth"] == [1.0, 1.0, 1.0]
        assert entry["n"] == 3 * 2 * r  # depths × documents × queries per document
    assert result["heatmap"]["accuracy"] == [[1.0, 1.0, 1.0]]


def test_needle_accuracy_per_cell_follows_where_the_needle_is():
    # Right only for needles starting before token 100: at depth 0 always; at depth 1 only in
    # the 200-token document (needle near token 80), not the 256-token one (near token 135).
    limited = FakeModel(decode=retrieval_oracle(limit=100), max_seq_len=256)
    options = needle.NeedleOptions(settings=("1:1",), heatmap="1:1", depths=(0.0, 1.0), lengths=(200, 256), samples=3)
    result = needle.run(ModelUnderTest("limited", limited, TOK), options, TEXT, progress=False)
    assert result["table"]["1:1"]["by_depth"] == [1.0, 0.0] and result["table"]["1:1"]["accuracy"] == 0.5
    assert result["heatmap"]["lengths"] == [200, 256]
    assert result["heatmap"]["accuracy"] == [[1.0, 1.0], [1.0, 0.0]]


# --- MQAR ------------------------------------------------------------------------------------------


def recall_oracle(skip_even_keys=False):
    """Next-token stand-in: predicts what followed the latest earlier occurrence of the current
    token (an induction head), else the gap token; optionally wrong (gap) after even key ids."""
    keys, _, gap = mqar_vocabulary(TOK)
    keys = set(keys)

    def next_logits(tokens):
        predicted = torch.full_like(tokens, gap)
        for b, row in enumerate(tokens.tolist()):
            last = {}
            for t, token in enumerate(row):
                if token in last and not (skip_even_keys and token in keys and token % 2 == 0):
                    predicted[b, t] = row[last[token] + 1]
                last[token] = t
        return one_hot_logits(predicted)

    return next_logits


@pytest.mark.parametrize("skip_even_keys", [False, True])
def test_mqar_scores_the_queried_values_only(skip_even_keys, monkeypatch):
    built = []
    real_build = mqar.build_mqar_example
    monkeypatch.setattr(mqar, "build_mqar_example", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    model = FakeModel(recall_oracle(skip_even_keys), max_seq_len=128)
    options = mqar.MQAROptions(seq_lens=(64, 128), pairs=(4, 8), samples=3, batch_size=2)
    result = mqar.run(ModelUnderTest("recall", model, TOK), options, TEXT, progress=False)
    keys, _, gap = mqar_vocabulary(TOK)
    expected = []
    for length, pairs in ((64, 4), (64, 8), (128, 4), (128, 8)):
        cell, built[: options.samples] = built[: options.samples], []
        right = total = 0
        for example in cell:
            tokens = example.tokens
            # Queries, found by rule: after the pairs, a key token (never the gap); score its successor.
            queries = [p for p in range(1 + 2 * pairs, length) if tokens[p - 1] in keys]
            assert len(queries) == pairs
            total += len(queries)
            right += sum(not (skip_even_keys and tokens[p - 1] % 2 == 0) for p in queries)
        expected.append(right / total)
    got = [c["accuracy"] for c in result["cells"]]
    assert [(c["seq_len"], c["pairs"]) for c in result["cells"]] == [(64, 4), (64, 8), (128, 4), (128, 8)]
    assert got == pytest.approx(expected, abs=1e-12)
    if not skip_even_keys:
        assert got == [1.0] * 4
    else:
        assert 0.0 < min(got) and max(got) < 1.0  # the planted misses are seen
    assert result["accuracy"] == pytest.approx(sum(expected) / 4)


# --- position NLL and AR-Hit ------------------------------------------------------------------------


def byte_windows(text, length, count):
    """Windows (count, length + 1) of the text's bytes + eos, cut at multiples of len // count."""
    stream = torch.tensor(TOK.encode(text) + [TOK.eos_id])
    stride = stream.numel() // count
    return torch.stack([stream[i * stride : i * stride + length + 1] for i in range(count)])


def test_position_nll_is_the_cumulative_average_of_the_per_position_mean():
    table = bigram_table()
    text = " ".join(random.Random(1).choices(ICL_WORDS, k=400))
    model = FakeModel(lambda tokens: table[tokens], max_seq_len=64)
    result = position_nll.run(ModelUnderTest("bigram", model, TOK),
                              position_nll.PositionNLLOptions(windows=3, batch_size=2),
                              EvalText([text]), progress=False)
    nll = bigram_nll(table, byte_windows(text, 64, 3))  # (3, 64)
    per_position = nll.mean(0)
    cumulative = [float(per_position[: t + 1].sum()) / (t + 1) for t in range(64)]
    assert result["nll"] == pytest.approx(per_position.tolist(), abs=1e-5)
    assert result["cumulative"] == pytest.approx(cumulative, abs=1e-5)
    assert result["at"] == pytest.approx({"16": cumulative[15], "32": cumulative[31], "64": cumulative[63]}, abs=1e-5)
    assert result["per_window"] == pytest.approx(nll.mean(1).tolist(), abs=1e-5)


def test_ar_hit_mask_by_hand():
    tokens = [5, 6, 7, 5, 6, 8, 6, 7, 5, 6]
    # Flag t is about tokens[t + 1]; bigrams ending there: 56 67 75 56* 68 86 67* 75* 56*.
    assert ar_hit.ar_hit_mask(tokens, 2) == [False, False, False, True, False, False, True, True, True]
    # Trigrams: 567 675 756 568 686 867 675* 756*.
    assert ar_hit.ar_hit_mask(tokens, 3) == [False] * 7 + [True, True]
    # Unigrams: the target token itself was seen before.
    assert ar_hit.ar_hit_mask(tokens, 1) == [False, False, True, True, False, True, True, True, True]


def test_ar_hit_split_of_the_model_loss():
    table = bigram_table(1)
    text = " ".join(random.Random(2).choices(ICL_WORDS[:12], k=300))  # few words: many repeated bigrams
    model = FakeModel(lambda tokens: table[tokens], max_seq_len=48)
    result = ar_hit.run(ModelUnderTest("bigram", model, TOK), ar_hit.ARHitOptions(windows=2, batch_size=1),
                        EvalText([text]), progress=False)
    windows = byte_windows(text, 48, 2)
    nll = bigram_nll(table, windows)
    hits = torch.zeros(2, 48, dtype=torch.bool)
    for n in range(2):
        w = windows[n].tolist()
        for t in range(1, 48):  # target w[t + 1] completes the bigram (w[t], w[t + 1]) seen at (w[j-1], w[j]), j ≤ t
            hits[n, t] = any(w[j - 1] == w[t] and w[j] == w[t + 1] for j in range(1, t + 1))
    assert 0 < int(hits.sum()) < hits.numel()
    assert result["valid"] == pytest.approx(float(nll.mean()), abs=1e-5)
    assert result["ar_hit"] == pytest.approx(float(nll[hits].mean()), abs=1e-5)
    assert result["others"] == pytest.approx(float(nll[~hits].mean()), abs=1e-5)
    assert result["hit_fraction"] == pytest.approx(float(hits.float().mean()), abs=1e-9)


# --- activation outliers ------------------------------------------------------------------------------


def test_logit_tap_reads_both_maps_and_skips_masked_positions():
    stats = outliers.MagnitudeStats(1.0, seed=0)
    inf = float("-inf")
    l1 = torch.tensor([[1.0, inf], [-3.0, 2.0]])
    l2 = torch.tensor([[-7.0, inf], [0.5, 4.0]])
    probs = torch.tensor([[1.0, 0.0], [0.1, 0.9]])
    outliers.LogitTap(stats).record(0, AttentionMaps(logits=(l1, l2), probs=(probs, probs), combined=probs))
    summary = stats.summary()
    assert (summary["top1"], summary["top2"], summary["top3"]) == (7.0, 4.0, 3.0)
    assert summary["count"] == 6 and summary["median"] == 2.0  # |1 3 2 7 .5 4|: lower middle of 6 values


def test_massive_activations_are_each_layers_top_magnitude_over_its_median():
    """Per layer (Sun et al. 2024): layer 0 |1 2 −3 100| has top-1 100 and median 2 (the lower middle of four),
    ratio 50; layer 1 |0.5 −4 1 2 0.5| top-1 4, median 1, ratio 4; layer 2, all zeros, has no ratio."""
    stats = outliers.MagnitudeStats(1.0, seed=0)
    stats.update(torch.tensor([1.0, 2.0, -3.0, 100.0]), layer_index=0)
    stats.update(torch.tensor([0.5, -4.0, 1.0]), layer_index=1)
    stats.update(torch.tensor([2.0, 0.5]), layer_index=1)  # a layer's values may come in several updates
    stats.update(torch.zeros(3), layer_index=2)
    summary = stats.summary()
    assert summary["per_layer_top1"] == [100.0, 4.0, 0.0]
    assert summary["per_layer_median"] == [2.0, 1.0, 0.0]
    assert summary["per_layer_ratio"] == [50.0, 4.0, None]
    assert summary["median"] == 1.0  # over every layer: |0 0 0 .5 .5 1 1 2 2 3 4 100|, the lower middle


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_outliers_are_the_logits_of_every_map_and_the_output_of_every_block(kind):
    model = tiny(kind, n_layers=2, max_seq_len=24)
    with torch.no_grad():
        for layer in model.layers:  # distinct magnitudes per layer and map, so that a dropped one shows
            layer.attn.q_proj.weight.mul_(30.0 * (layer.attn.layer_index + 1))
    seen = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    result = outliers.run(ModelUnderTest(kind, model, TOK), outliers.OutlierOptions(tokens=48, batch_size=2), TEXT,
                          progress=False)
    tokens = torch.cat(seen)  # (2, 24): the windows' inputs
    assert tokens.shape == (2, 24)
    with torch.no_grad():
        logit_maps, hidden = oracle_forward(model, tokens)
    visible = torch.ones(24, 24, dtype=torch.bool).tril()
    logits = torch.cat([m[..., visible].abs().flatten() for maps in logit_maps for m in maps])
    states = torch.cat([h.abs().flatten() for h in hidden])
    for got, values in ((result["attention_logits"], logits), (result["hidden_states"], states)):
        top = values.sort(descending=True).values
        assert got["count"] == values.numel()
        for rank in outliers.RANKS:
            assert got[f"top{rank}"] == pytest.approx(float(top[rank - 1]), rel=1e-4)
        assert got["median"] == pytest.approx(float(values.median()), rel=1e-4)
    per_layer = [float(torch.cat([m[..., visible].abs().flatten() for m in maps]).max()) for maps in logit_maps]
    assert result["attention_logits"]["per_layer_top1"] == pytest.approx(per_layer, rel=1e-4)
    assert result["hidden_states"]["per_layer_top1"] == pytest.approx([float(h.abs().max()) for h in hidden], rel=1e-4)
    medians = [float(h.abs().median()) for h in hidden]
    assert result["hidden_states"]["per_layer_median"] == pytest.approx(medians, rel=1e-4)
    assert result["hidden_states"]["per_layer_ratio"] == pytest.approx(
        [float(h.abs().max()) / m for h, m in zip(hidden, medians)], rel=1e-4)


# --- quantisation -------------------------------------------------------------------------------------


class QuantizeAndRecord(quantization.QuantizeTap):
    def __init__(self, bits, granularity):
        super().__init__(bits, granularity)
        self.maps = {}

    def record(self, layer_index, maps):
        self.maps[layer_index] = maps


@pytest.mark.parametrize("granularity", ["row", "head"])
@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2"])
def test_quantisation_rounds_every_logit_map_to_its_absmax_grid(kind, granularity):
    model = tiny(kind, n_layers=1)
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.mul_(20)  # logits of several units, so 4 bits is coarse
    tokens = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        with model.tap_attention(QuantizeAndRecord(None, granularity)) as plain:
            model(tokens)
        with model.tap_attention(QuantizeAndRecord(4, granularity)) as quantised:
            out4 = model(tokens)[0]
    visible = torch.ones(10, 10, dtype=torch.bool).tril()
    before, after = plain.maps[0], quantised.maps[0]
    assert len(after.logits) == (2 if kind == "diff" else 1)
    for x, got in zip(before.logits, after.logits):
        # Oracle: 7 levels each side; the step is absmax / 7 over the visible logits of each row or head.
        magnitude = torch.where(visible, x.abs(), torch.zeros_like(x))
        absmax = magnitude.amax(-1, keepdim=True) if granularity == "row" else magnitude.amax((-2, -1), keepdim=True)
        step = absmax / 7
        want = (x / step).round().clamp(-7, 7) * step
        torch.testing.assert_close(got[..., visible], want[..., visible], atol=1e-5, rtol=1e-5)
        assert torch.isneginf(got[..., ~visible]).all()
        assert (got[..., visible] - x[..., visible]).abs().max() > 0.05  # 4 bits really moved them
    for p, logit in zip(after.probs, after.logits):  # the softmax sees the quantised logits
        torch.testing.assert_close(p, logit.softmax(-1), atol=1e-6, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(out4, model(tokens)[0], atol=1e-4)


def test_quantisation_needle_accuracy_scores_answer_tokens_by_teacher_forcing():
    # Two documents of distinct tokens; token 0 names the document. The stand-in predicts every
    # next token right except those listed: document 1 misses token 5 (the first answer token of
    # its first span), document 2 misses token 8 (just after its span, not scored).
    docs = [SimpleNamespace(tokens=[1] + list(range(10, 25)), answer_spans=[(5, 8), (12, 14)]),
            SimpleNamespace(tokens=[2] + list(range(30, 45)), answer_spans=[(5, 8)])]
    misses = {1: {5}, 2: {8}}

    def next_logits(tokens):
        predicted = torch.zeros_like(tokens)
        for b, row in enumerate(tokens.tolist()):
            full = next(d.tokens for d in docs if d.tokens[0] == row[0])
            for t in range(len(row)):
                predicted[b, t] = 0 if t + 1 in misses[row[0]] else full[t + 1]
        return one_hot_logits(predicted)

    mut = ModelUnderTest("fake", FakeModel(next_logits), TOK)
    assert quantization._needle_accuracy(mut, docs, batch_size=2) == pytest.approx(2 / 3)


def test_cloze_scores_only_the_continuation():
    table = bigram_table(3)
    model = FakeModel(lambda tokens: table[tokens])
    sequences = [[3, 4, 5, 6, 7], [3, 4, 9], [8, 1, 2, 2, 2, 2]]
    scored_from = [3, 2, 1]
    want = [sum(float(table[s[i - 1]].log_softmax(-1)[s[i]]) for i in range(f, len(s)))
            for s, f in zip(sequences, scored_from)]
    assert score_sequences(model, sequences, scored_from, batch_size=2) == pytest.approx(want, abs=1e-5)
    # _cloze_correct: the choice with the highest sum wins; item answers by the oracle's own argmax.
    context = [3, 4]
    choices = [[5, 6], [7, 7], [9, 1]]
    sums = [sum(float(table[s[i - 1]].log_softmax(-1)[s[i]]) for i in range(2, 4))
            for s in (context + c for c in choices)]
    best = int(np.argmax(sums))
    items = [(context, choices, best), (context, choices, (best + 1) % 3)]
    assert quantization._cloze_correct(ModelUnderTest("fake", model, TOK), items, batch_size=4) == [1, 0]


# --- in-context learning --------------------------------------------------------------------------------


@pytest.mark.slow  # scores every choice (3 s)
def test_constrained_decoding_scores_the_choice_tokens_after_prefix_and_query():
    model = tiny("diff", n_layers=2)
    prefix = [256, 10, 20, 30, 40]
    queries = [[50, 60], [70, 80, 90], [11, 12]]
    choices = [[100], [101, 102], [103, 104, 105]]
    got = score_choices(model, prefix, queries, choices, batch_size=4)
    with torch.no_grad():
        for i, q in enumerate(queries):
            for c, choice in enumerate(choices):
                seq = torch.tensor([prefix + q + choice])
                logp = model(seq[:, :-1])[0].float().log_softmax(-1)[0]  # one full pass, no cache
                start = len(prefix) + len(q)
                want = sum(float(logp[start + j - 1, tok]) for j, tok in enumerate(choice))
                assert got[i][c] == pytest.approx(want, abs=2e-4), (i, c)


def test_icl_accuracy_is_the_argmax_label_over_the_constrained_scores(monkeypatch):
    task = ClassificationTask(name="t", labels=["red", "blue", "green"],
                              items=[("a b", 0), ("c d", 1), ("e f", 2), ("g h", 0)])
    calls = []

    def fake_scores(model, prefix, queries, choices, *, batch_size):
        calls.append((prefix, queries, choices))
        return [[-1.0, -0.5, -3.0], [-2.0, -0.1, -0.2], [-0.3, -0.9, -0.1], [-4.0, -5.0, -6.0]]  # argmax 1 1 2 0

    monkeypatch.setattr(icl, "score_choices", fake_scores)
    demos = [("x y", 2), ("z w", 0)]
    accuracy, prompt_tokens = icl._accuracy(ModelUnderTest("m", FakeModel(), TOK), task, demos, task.items, 8)
    assert accuracy == 0.75  # items 0 (label 0) wrong; 1, 2, 3 right
    prefix, queries, choices = calls[0]
    assert prefix == [TOK.eos_id] + TOK.encode("Input: x y\nLabel: green\nInput: z w\nLabel: red\n")
    assert prompt_tokens == len(prefix)
    assert queries[1] == TOK.encode("Input: c d\nLabel:")
    assert choices == [TOK.encode(" red"), TOK.encode(" blue"), TOK.encode(" green")]


def test_alternating_layout_cycles_the_classes():
    demos = [(f"t{i}", i % 3) for i in range(9)]
    for k in range(4):
        ordered = icl.arrange(demos, "alternating", random.Random(k))
        labels = [label for _, label in ordered]
        assert sorted(ordered) == sorted(demos)
        assert labels[:3] == labels[3:6] == labels[6:9] and sorted(labels[:3]) == [0, 1, 2]


# --- scaling ------------------------------------------------------------------------------------------


def test_scaling_against_tokens_reads_the_papers_token_fraction():
    """Token scaling: DIFF's law is the baseline's at 0.637× the tokens (Figure 3b's figure); each kind its
    own floor, three seeds a cell (noise 0.002): the fraction at every baseline x, and summarised."""
    base = lambda x: 9.0 * x ** -0.1 + 1.2  # noqa: E731
    tokens = [1e8, 3e8, 1e9, 3e9]
    noise = (-0.002, 0.0, 0.002)
    runs = [{"attention": "standard", "params": 1e8, "tokens": n, "loss": base(n) + e, "seed": s}
            for n in tokens for s, e in enumerate(noise)]
    runs += [{"attention": "diff", "params": 1e8, "tokens": n, "loss": base(n / 0.637) + e, "seed": s}
             for n in tokens for s, e in enumerate(noise)]
    result = scaling.evaluate(scaling.runs_from_json(runs), x_kind="tokens")
    law = result["architectures"]["standard"]["law"]
    assert (law["a"], law["b"], law["c"]) == pytest.approx((9.0, 0.1, 1.2), rel=0.05)
    assert not result["shared_floor"]
    match = result["matching"]["diff"]
    assert [r["baseline_x"] for r in match["readings"]] == tokens
    assert [r["fraction"] for r in match["readings"]] == pytest.approx([0.637] * 4, rel=0.03)
    assert [r["loss"] for r in match["readings"]] == pytest.approx([base(n) for n in tokens], abs=2e-3)
    assert match["identified"] and match["fraction"] == pytest.approx(0.637, rel=0.03)
    assert match["at"] == pytest.approx(math.sqrt(1e8 * 3e9))  # the geometric centre of the 4 budgets
