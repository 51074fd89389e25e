"""AR-Hit / Others split of the loss, and cumulative NLL by position."""

import random

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.data.synthetic import ICL_WORDS
from diff_transformer.evaluation import EvalText, ModelUnderTest, ar_hit, position_nll
from diff_transformer.evaluation.scoring import token_nll
from diff_transformer.evaluation.stats import difference_noise
from diff_transformer.tokenizer import ByteTokenizer

TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=3000))])


def test_ar_hit_bigrams_on_a_hand_made_sequence():
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 5, 6, 9, 6, 7, 5]
    # targets are tokens[1:]; a target is a hit when (previous token, target) appeared before:
    # t=1 (5,6) new; t=2 (6,7) new; t=3 (7,5) new; t=4 (5,6) seen at 0-1 -> hit; t=5 (6,9) new;
    # t=6 (9,6) new; t=7 (6,7) seen at 1-2 -> hit; t=8 (7,5) seen at 2-3 -> hit
    assert ar_hit.ar_hit_mask(tokens, 2) == [False, False, False, True, False, False, True, True]


def test_ar_hit_trigrams_and_unigrams():
    tokens = [5, 6, 7, 5, 6, 9, 6, 7, 5]
    # trigram ending at t=4 is (7,5,6): new; t=8 (6,7,5): seen at 1-3 -> the only hit
    assert ar_hit.ar_hit_mask(tokens, 3) == [False] * 7 + [True]
    # unigram: the target token itself appeared before
    assert ar_hit.ar_hit_mask(tokens, 1) == [False, False, True, True, False, True, True, True]
    with pytest.raises(ValueError):
        ar_hit.ar_hit_mask(tokens, 0)


def test_split_loss_weights_tokens_not_windows():
    nll = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    hits = torch.tensor([[True, False, False], [True, True, False]])
    split = ar_hit.split_loss(nll, hits)
    assert split["valid"] == pytest.approx(3.5)
    assert split["ar_hit"] == pytest.approx((1 + 4 + 5) / 3)
    assert split["others"] == pytest.approx((2 + 3 + 6) / 3)
    assert split["hit_fraction"] == pytest.approx(0.5)
    assert split["per_window"]["ar_hit"] == pytest.approx([1.0, 4.5])


def model_under_test(kind="diff", max_seq_len=64):
    torch.manual_seed(0)
    return ModelUnderTest(
        kind, LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=max_seq_len)).eval(),
        ByteTokenizer())


def test_token_nll_matches_the_model_loss():
    mut = model_under_test()
    windows = TEXT.windows(mut.tokenizer, 64, 3)
    nll = token_nll(mut.model, windows, batch_size=2)
    with torch.no_grad():
        _, loss = mut.model(windows[:, :-1], windows[:, 1:])
    assert nll.shape == (3, 64)
    assert float(nll.mean()) == pytest.approx(float(loss), abs=1e-5)


def test_ar_hit_run_is_consistent():
    mut = model_under_test()
    result = ar_hit.run(mut, ar_hit.ARHitOptions(windows=3), TEXT, progress=False)
    share = result["hit_fraction"]
    assert 0 < share < 1 and result["tokens"] == 3 * 64
    assert result["valid"] == pytest.approx(share * result["ar_hit"] + (1 - share) * result["others"], abs=1e-5)


def test_position_nll_is_a_cumulative_average():
    assert position_nll.cumulative_average([3.0, 1.0, 2.0]) == [3.0, 2.0, 2.0]
    mut = model_under_test("standard")
    result = position_nll.run(mut, position_nll.PositionNLLOptions(windows=3), TEXT, progress=False)
    windows = TEXT.windows(mut.tokenizer, 64, 3)
    with torch.no_grad():
        logits, _ = mut.model(windows[:, :-1])
    expected = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)
    assert result["nll"] == pytest.approx(expected.tolist(), abs=1e-4)
    assert result["cumulative"][-1] == pytest.approx(float(expected.mean()), abs=1e-4)
    assert list(result["at"]) == ["16", "32", "64"]


def test_difference_noise_pairs_windows_when_the_text_is_the_same():
    a = {"loss": [1.0, 2.0, 3.0], "windows_fingerprint": "x"}
    b = {"loss": [1.1, 2.1, 3.1], "windows_fingerprint": "x"}
    assert difference_noise(a, b, "loss") == pytest.approx(0.0, abs=1e-9)  # a constant shift is certain
    assert difference_noise(a, {**b, "windows_fingerprint": "y"}, "loss") > 0.5  # unpaired: window spread counts
