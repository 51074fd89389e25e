"""`eval context-qa` and the lookback ratio: the ratio on a hand-computed map, the rows an answer reads
(against a full pass), SQuAD's normalisation, the scores of planted answers, the AUROC by counting
pairs, bad input refused by line, and a run on a trained checkpoint with the shipped sample."""

import json
import math

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.attention import AttentionTap
from diff_transformer.cli import main
from diff_transformer.evaluation import EvalText, run_suite
from diff_transformer.evaluation.context_qa import (
    SAMPLE, ContextQAOptions, answer_lookback, answer_of, encode_item, exact_match, in_context, load_items,
    normalize_answer, run, separation,
)
from diff_transformer.evaluation.lookback import LOOKBACK_DEFINITION, LookbackTap, lookback_ratios
from diff_transformer.evaluation.models import ModelUnderTest
from diff_transformer.evaluation.stats import auroc, auroc_interval
from diff_transformer.ops import AttentionMaps
from diff_transformer.tokenizer import ByteTokenizer
from test_train import byte_dataset, debug_config  # noqa: F401  (byte_dataset is a fixture)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the lookback ratio on a hand-computed map ---------------------------------------------------------


def test_the_lookback_ratio_of_a_hand_computed_signed_map():
    # One example, two heads, the rows of positions 4 and 5 over keys 0-5; the context ends at m = 2.
    # Head 0 is signed (a differential map), head 1 a softmax map.
    rows = torch.tensor([[[0.30, -0.10, 0.20, -0.10, 0.50, 0.00],    # C = (.3 + .1) / 2 = .2, N = (.2 + .1 + .5) / 3
                          [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]],     # C = .1, N = .2
                         [[0.10, 0.10, 0.10, 0.20, 0.50, 0.00],      # C = .1, N = .8 / 3
                          [1 / 6] * 6]])                              # C = N
    expected = torch.tensor([[0.2 / (0.2 + 0.8 / 3), 0.1 / 0.3], [0.1 / (0.1 + 0.8 / 3), 0.5]])
    assert lookback_ratios(rows, [4, 5], [2, 2]) == pytest.approx(expected, abs=1e-6)
    # The tap reads the same rows from the maps of a call that continues a cache of 4 positions.
    tap = LookbackTap([[(4, 2), (5, 2)]])
    combined = rows[None]  # (B=1, H=2, T=2, S=6): queries 4 and 5
    tap.record(0, AttentionMaps(logits=(), probs=(), combined=combined))
    assert tap.per_example()[0][0] == pytest.approx(expected, abs=1e-6)
    assert math.isnan(lookback_ratios(torch.zeros(1, 1, 4), [3], [1])[0, 0])  # an all-zero row: undefined
    with pytest.raises(ValueError, match="context end"):
        lookback_ratios(rows, [4, 5], [0, 2])
    assert "|A[i, j]|" in LOOKBACK_DEFINITION and "m <= j <= i" in LOOKBACK_DEFINITION


class _Maps(AttentionTap):
    def __init__(self):
        self.combined = {}

    def record(self, layer_index, maps):
        self.combined[layer_index] = maps.combined.double()


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2"])
def test_an_answers_rows_through_the_cache_are_those_of_a_full_pass(kind):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, vocab_size=257, max_seq_len=64)).eval()
    tokens = torch.randint(0, 257, (30,)).tolist()
    prompt_length, marker, rows = 24, 20, 4  # the prompt's last position and 3 answer tokens answer
    got = answer_lookback(model, tokens, marker, prompt_length, rows)
    maps = _Maps()
    with torch.no_grad(), model.tap_attention(maps):
        model(torch.tensor([tokens]))
    for layer, combined in maps.combined.items():
        for head in range(combined.shape[1]):
            ratios = []
            for i in range(prompt_length - 1, prompt_length - 1 + rows):
                row = combined[0, head, i]
                context = sum(abs(float(row[j])) for j in range(marker)) / marker
                new = sum(abs(float(row[j])) for j in range(marker, i + 1)) / (i + 1 - marker)
                ratios.append(context / (context + new))
            assert float(got[layer, head]) == pytest.approx(sum(ratios) / rows, abs=1e-5)


# --- scoring an answer -------------------------------------------------------------------------------------


def test_answers_are_normalised_as_squad_normalises_them():
    assert normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"  # punctuation dropped, not spaced
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("theatre anatomy") == "theatre anatomy"  # articles only as whole words
    assert exact_match("the Pebble.", ["Pebble"]) and exact_match("3", ["three", "3"])
    assert not exact_match("Pebbles", ["Pebble"])
    assert in_context("Tomas Heill", "built in 1887 by Tomas Heill.")
    assert not in_context("Heil", "built in 1887 by Tomas Heill.")  # on word boundaries
    assert not in_context("", "anything") and not in_context("the", "the cat")  # nothing left to find


def test_the_answer_ends_at_the_first_newline():
    tok = ByteTokenizer()
    assert answer_of(tok, tok.encode(" Tomas Heill\nQuestion")) == ("Tomas Heill", 12)
    assert answer_of(tok, tok.encode("\nx")) == ("", 0)
    assert answer_of(tok, tok.encode(" 1887")) == ("1887", 5)
    item = load_items(SAMPLE)[0]
    tokens, marker = encode_item(tok, item)
    assert tokens[0] == tok.eos_id and tok.decode(tokens[1:marker]) == item.context + "\nQuestion: " + item.question
    assert tok.decode(tokens[marker:]) == "\nAnswer:"


class _Planted(LanguageModel):
    """A model whose greedy answers are planted (prompt -> generated tokens); its attention is real."""

    answers: dict = {}

    def generate(self, prompts, max_new_tokens, **sampling):
        return [list(self.answers[tuple(p)]) for p in prompts]


def _items(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_planted_answers_are_scored_by_exact_match_and_by_the_context(tmp_path):
    tok = ByteTokenizer()
    records = [
        {"context": "The lighthouse was built by Tomas Heill.", "question": "Who built it?",
         "answers": ["Tomas Heill"]},
        {"context": "Her donkey is named Pebble.", "question": "The donkey's name?", "answers": "Pebble"},
        {"context": "The capital of France is Lyon.", "question": "The capital?", "answers": ["Paris"]},
        {"context": "The bakery sells rye bread.", "question": "Who owns it?", "answers": ["unknown"]},
    ]
    planted = [" Tomas Heill\nQuestion", " the pebble.", " Lyon", " banana"]
    data = _items(tmp_path / "qa.jsonl", records)
    torch.manual_seed(0)
    model = _Planted(ModelConfig.from_preset("debug", vocab_size=257, max_seq_len=128)).eval()
    model.answers = {tuple(encode_item(tok, item)[0]): tok.encode(text)
                     for item, text in zip(load_items(data), planted)}
    result = run(ModelUnderTest("planted", model, tok), ContextQAOptions(data=str(data), resamples=200), EvalText(),
                 progress=False)
    answers = result["answers"]
    assert [a["prediction"] for a in answers] == ["Tomas Heill", "the pebble.", "Lyon", "banana"]
    assert [a["exact_match"] for a in answers] == [True, True, False, False]
    assert [a["in_context"] for a in answers] == [True, True, True, False]  # Lyon: from the context, wrong
    assert [a["answer_in_context"] for a in answers] == [True, True, False, False]
    assert result["exact_match"] == 0.5 and result["prediction_in_context"] == 0.75
    assert result["answer_in_context"] == 0.5 and result["exact_match_answer_in_context"] == 1.0
    look = result["lookback"]
    assert look["right"] == 2 and look["wrong"] == 2 and look["definition"] == LOOKBACK_DEFINITION
    for layer, entry in enumerate(look["auroc"]):  # by counting pairs: right outscores wrong, ties one half
        means = [sum(a["lookback"][layer]) / len(a["lookback"][layer]) for a in answers]
        pairs = [(r, w) for r in means[:2] for w in means[2:]]
        assert entry["auroc"] == pytest.approx(sum(1.0 if r > w else 0.5 if r == w else 0.0 for r, w in pairs) / 4,
                                               abs=1e-3)
    # Each answer's ratio is that of its own rows: the 12 tokens of " Tomas Heill" before the newline.
    prompt, marker = encode_item(tok, load_items(data)[0])
    rows = answer_lookback(model, prompt + tok.encode(planted[0]), marker, len(prompt), 12)
    assert torch.tensor(answers[0]["lookback"]) == pytest.approx(rows, abs=1e-4)


def test_the_auroc_counts_pairs_and_its_interval_resamples_each_group():
    assert auroc([0.9, 0.8, 0.4], [0.5, 0.3]) == pytest.approx(5 / 6)  # 5 of the 6 pairs ordered right
    assert auroc([0.5, 0.5], [0.5]) == 0.5 and auroc([], [0.1]) is None
    low, high = auroc_interval([0.9, 0.8, 0.4, 0.7], [0.5, 0.3, 0.6], resamples=500)
    assert 0.0 <= low <= auroc([0.9, 0.8, 0.4, 0.7], [0.5, 0.3, 0.6]) <= high <= 1.0
    assert auroc_interval([0.9], [0.1, 0.2]) is None  # a group of one: no interval
    ratios = [torch.tensor([[0.9, 0.7]]), torch.tensor([[0.6, 0.6]]), torch.tensor([[0.2, 0.4]]),
              torch.tensor([[0.8, 0.6]])]  # one layer, two heads
    found = separation(ratios, [True, False, False, True], ContextQAOptions(resamples=100))
    # head means 0.8, 0.6, 0.3, 0.7: right {0.8, 0.7} above wrong {0.6, 0.3} in all four pairs.
    assert found["auroc"][0]["auroc"] == pytest.approx(1.0) and found["per_layer"] == pytest.approx([0.6])
    # head 1: right {0.7, 0.6} against wrong {0.6, 0.4}: three pairs ordered right and one tie.
    assert found["per_head_auroc"] == [[pytest.approx(1.0), pytest.approx(3.5 / 4)]]
    assert found["right"] == 2 and found["wrong"] == 2


# --- bad input --------------------------------------------------------------------------------------------


def test_bad_lines_are_refused_by_name_with_their_line_number(tmp_path):
    good = {"context": "c", "question": "q", "answers": ["x"]}
    for line, message in ((json.dumps({"context": "c", "question": "q"}), "missing field 'answers'"),
                          (json.dumps({**good, "answers": []}), "'answers' must be a non-empty list"),
                          (json.dumps({**good, "answers": ["the"]}), "'answers' must be a non-empty list"),
                          (json.dumps({**good, "context": " "}), "'context' must be a non-empty string"),
                          ("[1, 2]", "expected an object"),
                          ("{nope", "not valid JSON"),
                          (json.dumps({**good, "context": "a\u0000b"}), "field 'context': binary data")):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:3: {message}"):
            load_items(path)
    (tmp_path / "binary.jsonl").write_bytes(json.dumps(good).encode() + b"\n\x00\x01")
    with pytest.raises(ValueError, match="binary.jsonl: binary data"):
        load_items(tmp_path / "binary.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no items"):
        load_items(tmp_path / "empty.jsonl")
    assert len(load_items(SAMPLE)) == 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257, max_seq_len=192))
    return model.save_pretrained(tmp_path_factory.mktemp("ckpt") / "diff", ByteTokenizer())


def test_the_command_refuses_bad_input_with_status_2_and_writes_nothing(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    bad = _items(tmp_path / "bad.jsonl", [{"context": "c", "question": "q", "answers": ["x"]},
                                          {"context": "c", "question": "q", "answer": "x"}])
    # The file is read when the flag is parsed, before any model loads.
    assert main(["eval", "context-qa", "--checkpoint", str(checkpoint), "--data", str(bad), "--out", str(out)]) == 2
    assert f"{bad}:2: missing field 'answers'" in capsys.readouterr().err
    long = _items(tmp_path / "long.jsonl", [{"context": "short", "question": "q", "answers": ["x"]},
                                            {"context": "word " * 40, "question": "q", "answers": ["x"]}])
    assert main(["eval", "context-qa", "--checkpoint", str(checkpoint), "--data", str(long), "--out", str(out),
                 "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert f"{long}:2: the prompt is 221 tokens" in error and "context of 192 tokens" in error
    assert error.rstrip().endswith("nothing written") and not out.exists()


@pytest.mark.slow  # trains a model for a few steps, then answers the 20 questions of the sample
def test_the_command_runs_on_a_trained_checkpoint_with_the_shipped_sample(byte_dataset, tmp_path, capsys):  # noqa: F811
    from diff_transformer.train import train

    config = debug_config(byte_dataset, tmp_path / "run", models={"diff": {"attention": "diff"}},
                          model={"preset": "debug", "max_seq_len": 192})
    result = train(config, "diff")
    assert result.status == "completed"
    out = tmp_path / "eval"
    assert main(["eval", "context-qa", "--checkpoint", str(tmp_path / "run" / "checkpoint"), "--label", "DIFF",
                 "--out", str(out), "--quick", "--no-progress"]) == 0
    data = json.loads((out / "context-qa.json").read_text())["models"]["DIFF"]
    assert data["items"] == 20 and len(data["answers"]) == 20 and data["data"] == str(SAMPLE)
    # per layer, per head: the debug DIFF model has 2 layers of 2 DIFF heads
    assert [[len(layer) for layer in a["lookback"]] for a in data["answers"]] == [[2, 2]] * 20
    assert all(0.0 <= v <= 1.0 for a in data["answers"] for layer in a["lookback"] for v in layer)
    assert data["answer_in_context"] == 0.85  # 17 of the 20 sample answers are in their context
    assert (out / "context-qa.png").read_bytes()[:4] == b"\x89PNG"
    assert "| DIFF | 20 |" in capsys.readouterr().out


@pytest.mark.slow  # the suite end to end (1.7 s)
def test_it_runs_by_name_in_the_suite(checkpoint, tmp_path):
    result = run_suite({"diff": checkpoint}, tmp_path, evaluations=["context-qa"], quick=True, progress=False)
    data = result.data["context-qa"]
    assert data["errors"] == {} and data["models"]["diff"]["items"] == 20
    assert "Table 4" in result.sections["context-qa"]
