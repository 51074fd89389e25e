"""The n-gram references (evaluation/ngram.py) against tables counted by hand on a tiny corpus."""

import json
import math

import numpy as np
import pytest

from diff_transformer.evaluation.ngram import (
    LEARNED_MARGIN, bigram_cross_entropies, ngram_reference, ngram_reference_of, spread_stretches,
    unigram_cross_entropy,
)

# train 0 1 0 1 2 (V = 3): c(0) = 2, c(1) = 2, c(2) = 1 of N = 5; pairs (0,1) ×2, (1,0), (1,2); as a
# context (the first of a pair) 0 twice, 1 twice, 2 never. val 1 0 1 2 0: predicted 0, 1, 2, 0.
TRAIN = np.array([0, 1, 0, 1, 2])
VAL = np.array([1, 0, 1, 2, 0])


def test_unigram_is_add_one_smoothed_counts_of_the_training_split():
    p = {0: 3 / 8, 1: 3 / 8, 2: 2 / 8}  # (c + 1) / (N + V)
    expected = -(math.log(p[0]) + math.log(p[1]) + math.log(p[2]) + math.log(p[0])) / 4
    assert unigram_cross_entropy(TRAIN, VAL, 3) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("alpha", [1.0, 100.0])
def test_bigram_is_the_counts_under_a_dirichlet_prior_on_the_unigram(alpha):
    p = {0: 3 / 8, 1: 3 / 8, 2: 2 / 8}
    by_hand = [
        (1 + alpha * p[0]) / (2 + alpha),  # 1 -> 0: c(1,0) = 1, c(1) = 2
        (2 + alpha * p[1]) / (2 + alpha),  # 0 -> 1: c(0,1) = 2, c(0) = 2
        (1 + alpha * p[2]) / (2 + alpha),  # 1 -> 2: c(1,2) = 1
        (0 + alpha * p[0]) / (0 + alpha),  # 2 -> 0: 2 never a context: the unigram alone
    ]
    expected = -sum(math.log(x) for x in by_hand) / 4
    assert bigram_cross_entropies(TRAIN, VAL, 3, [alpha])[alpha] == pytest.approx(expected, abs=1e-12)


def test_the_reference_takes_the_best_strength_and_judges_by_the_margin():
    reference = ngram_reference_of(TRAIN, VAL, 3, dataset="hand")
    every = bigram_cross_entropies(TRAIN, VAL, 3)
    assert reference.bigram == pytest.approx(min(every.values()))
    assert every[reference.bigram_alpha] == reference.bigram
    assert reference.learned(reference.bigram - LEARNED_MARGIN)
    assert not reference.learned(reference.bigram - LEARNED_MARGIN + 1e-6)
    assert not reference.learned(float("nan")) and not reference.learned(None)


def test_a_sequence_that_repeats_is_predicted_by_the_bigram_far_better_than_by_the_unigram():
    train = np.tile(np.arange(10), 500)  # 0 1 2 ... 9 0 1 ...: each token determines the next
    reference = ngram_reference_of(train, train[:200], 10)
    assert reference.unigram == pytest.approx(math.log(10), abs=1e-3)
    assert reference.bigram < 0.05


def test_a_prepared_dataset_is_measured_once_and_cached(tmp_path, monkeypatch):
    from diff_transformer.data.prepare import write_shards
    from diff_transformer.data.inputs import in_memory_documents
    from diff_transformer.tokenizer import ByteTokenizer

    monkeypatch.setenv("DIFF_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    documents = [(f"d{i}", "abcabcabd " * 40 + str(i)) for i in range(20)]
    (tmp_path / "data").mkdir()
    write_shards(in_memory_documents(documents), tmp_path / "data", ByteTokenizer(), tokenizer_source="bytes",
                 sources=[], val_fraction=0.2, seed=0, progress=False)
    reference = ngram_reference(str(tmp_path / "data"))
    assert reference.unit == "byte" and reference.vocab_size == 257
    assert reference.bigram < reference.unigram
    (cached,) = (tmp_path / "cache").glob("ngram-*.json")
    data = json.loads(cached.read_text())
    assert data["bigram"] == reference.bigram
    cached.write_text(json.dumps({**data, "bigram": 0.5}))  # a second call reads the cache, not the data
    assert ngram_reference(str(tmp_path / "data")).bigram == 0.5


def test_a_language_model_comparison_is_judged_only_where_both_models_passed_the_bigram():
    from diff_transformer.experiments.claims import NOT_LEARNED, AlongValues, Figures, make_claim

    reference = ngram_reference_of(np.tile(np.arange(10), 50), np.arange(10), 10)  # bigram ~0, unigram ln 10
    learned = lambda losses: reference.learned(float(np.mean(losses)))
    high, low = reference.bigram + 1.0, reference.bigram - 1.0  # above the bigram / well below it
    ours = Figures([low - 0.5, low - 0.4, low - 0.6],
                   along=[AlongValues(0.5, "half", [high + 0.1, high, high]), AlongValues(1.0, "all", [low - 0.5] * 3)])
    base = Figures([low, low + 0.1, low - 0.1],
                   along=[AlongValues(0.5, "half", [high, high, high]), AlongValues(1.0, "all", [low] * 3)])
    row = make_claim("LM", "loss", "lower", ours, base, "—", -1, learned=learned)
    assert row.verdict.startswith("agrees")  # both below the bigram at the end: DIFF lower, as the paper
    assert [p.judged for p in row.along] == [False, True]
    unlearned = Figures([high - 0.5] * 3)
    row = make_claim("LM", "loss", "lower", unlearned, Figures([high] * 3), "—", -1, learned=learned)
    assert row.verdict == NOT_LEARNED and row.difference.delta == pytest.approx(-0.5)
    assert make_claim("LM", "loss", "lower", unlearned, Figures([high] * 3), "—", -1).verdict.startswith("agrees")


def test_a_long_split_is_read_as_evenly_spaced_stretches():
    tokens = np.arange(1000)
    assert spread_stretches(tokens, 1000).tolist() == tokens.tolist()  # at the limit: whole
    read = spread_stretches(tokens, 100, stretches=4)  # 4 runs of 25, starting at 0, 325, 650 and 975
    assert read.tolist() == [*range(0, 25), *range(325, 350), *range(650, 675), *range(975, 1000)]
