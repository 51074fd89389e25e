"""Needle retrieval, in-context classification and MQAR on tiny models of every kind."""

import json
import random

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.data.synthetic import ICL_WORDS, ClassificationTask
from diff_transformer.evaluation import EvalText, ModelUnderTest, icl, mqar, needle
from diff_transformer.evaluation.scoring import score_choices, score_sequences
from diff_transformer.tokenizer import ByteTokenizer

KINDS = ["standard", "diff", "diff_v2"]
TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=3000))])


def model_under_test(kind, max_seq_len=256):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", attention=kind, max_seq_len=max_seq_len)
    return ModelUnderTest(kind, LanguageModel(config).eval(), ByteTokenizer())


def test_needle_settings_and_decoding_helpers():
    assert needle.parse_setting("4:2") == (4, 2)
    for bad in ("4", "2:4", "a:b"):
        with pytest.raises(ValueError):
            needle.parse_setting(bad)
    assert needle.decoded_number(" 4821. The") == "4821"
    assert needle.decoded_number(" The") == ""
    assert needle.context_lengths(needle.NeedleOptions(), 256) == [128, 192, 256]
    with pytest.raises(ValueError, match="max_seq_len"):
        needle.context_lengths(needle.NeedleOptions(lengths=(512,)), 256)


@pytest.mark.parametrize("kind", KINDS)
def test_needle_run_shapes(kind):
    mut = model_under_test(kind)
    options = needle.NeedleOptions(settings=("1:1", "2:2"), heatmap="1:1", depths=(0.0, 1.0), lengths=(128, 256),
                                   samples=2)
    result = needle.run(mut, options, TEXT, progress=False)
    assert set(result["table"]) == {"1:1", "2:2"} and result["length"] == 256
    assert result["table"]["1:1"]["n"] == 2 * 2 and result["table"]["2:2"]["n"] == 2 * 2 * 2
    heat = result["heatmap"]
    assert heat["lengths"] == [128, 256] and len(heat["accuracy"]) == 2 and len(heat["accuracy"][0]) == 2
    assert heat["accuracy"][0] == [None, None]  # 128 bytes cannot hold a needle document: skipped, not failed
    assert all(0.0 <= a <= 1.0 for a in heat["accuracy"][1])


def test_needle_accuracy_counts_exact_matches(monkeypatch):
    """A model that always writes the right number scores 1; one that writes another scores 0."""
    mut = model_under_test("standard")
    options = needle.NeedleOptions(settings=("2:2",), heatmap="2:2", depths=(0.5,), lengths=(256,), samples=2)

    def oracle(model, prompts, max_new_tokens, stop=()):
        out = []
        for p in prompts:
            text = mut.tokenizer.decode(p)
            city = text.rsplit("The magic number of ", 1)[1].removesuffix(" is")
            number = text.split(f"The magic number of {city} is ", 1)[1].split(".", 1)[0]
            out.append(mut.tokenizer.encode(f" {number}."))
        return out

    monkeypatch.setattr(needle, "greedy_decode", oracle)
    assert needle.run(mut, options, TEXT, progress=False)["table"]["2:2"]["accuracy"] == 1.0
    monkeypatch.setattr(needle, "greedy_decode",
                        lambda m, prompts, n, stop=(): [mut.tokenizer.encode(" 0.")] * len(prompts))
    assert needle.run(mut, options, TEXT, progress=False)["table"]["2:2"]["accuracy"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_scoring_equals_full_sequences(kind):
    mut = model_under_test(kind)
    enc = mut.tokenizer.encode
    prefix = enc("Input: apple river\nLabel: red\n")
    queries = [enc("Input: stone\nLabel:"), enc("Input: cloud\nLabel:"), enc("Input: a longer one\nLabel:")]
    choices = [enc(" red"), enc(" blue"), enc(" no")]  # several tokens each with bytes; padding to 5
    shared = score_choices(mut.model, prefix, queries, choices, batch_size=4)
    for query, row in zip(queries, shared):
        full = score_sequences(mut.model, [prefix + query + c for c in choices], [len(prefix) + len(query)] * 3)
        assert row == pytest.approx(full, abs=1e-4)
    one_token = score_choices(mut.model, prefix, queries, [[5], [9]])  # no branch pass needed
    full = score_sequences(mut.model, [prefix + queries[0] + [5], prefix + queries[0] + [9]],
                           [len(prefix) + len(queries[0])] * 2)
    assert one_token[0] == pytest.approx(full, abs=1e-4)


def test_arrange_layouts():
    demos = [(f"t{i}", i % 3) for i in range(9)]
    rng = random.Random(0)
    alternating = icl.arrange(demos, "alternating", rng)
    labels = [label for _, label in alternating]
    assert sorted(alternating) == sorted(demos)
    assert all(labels[i] != labels[i + 1] for i in range(len(labels) - 1))
    assert labels[:3] == labels[3:6] == labels[6:]  # the same cycle repeats
    shuffled = icl.arrange(demos, "random", rng)
    assert sorted(shuffled) == sorted(demos)


def test_test_items_are_class_balanced():
    task = ClassificationTask("t", ["a", "b", "c"],
                              [(f"x{i}", 0) for i in range(10)] + [("y0", 1), ("y1", 1)] + [("z0", 2)])
    tests, pool = icl.split_test_items(task, 6)
    assert sorted(label for _, label in tests) == [0, 0, 0, 1, 1, 2]  # b and c run out; a fills the rest
    assert len(pool) == 7 and not set(tests) & set(pool)


def test_jsonl_task_loading(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"sentence": f"text {i}", "y": ["pos", "neg"][i % 2]}) for i in range(6))
                    + "\n\n")
    task = icl.load_jsonl_task(path, "sentence", "y")
    assert task.labels == ["neg", "pos"] and len(task.items) == 6 and task.items[0] == ("text 0", 1)
    with pytest.raises(ValueError, match="fields"):
        icl.load_jsonl_task(path, "text", "y")
    path.write_text('{"sentence": "a", "y": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"data.jsonl:2"):
        icl.load_jsonl_task(path, "sentence", "y")


def test_constrained_decoding_picks_the_best_label(monkeypatch):
    mut = model_under_test("standard")
    task = ClassificationTask("t", ["red", "blue"], [("a", 0), ("b", 1)])

    def fake_scores(model, prefix, queries, choices, batch_size=64):  # right label of input "a" is red
        red = mut.tokenizer.encode(" red")
        return [[1.0 if ((b"Input: a" in bytes(q)) == (c == red)) else 0.0 for c in choices] for q in queries]

    monkeypatch.setattr(icl, "score_choices", fake_scores)
    accuracy, _ = icl._accuracy(mut, task, [], task.items, 64)
    assert accuracy == 1.0


@pytest.mark.slow  # many-shot prompts through every model
@pytest.mark.parametrize("kind", KINDS)
def test_icl_run_shapes(kind, tmp_path):
    path = tmp_path / "user.jsonl"
    rng = random.Random(0)
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.sample(ICL_WORDS, 3)), "label": rng.choice("ab")})
                              for _ in range(20)))
    mut = model_under_test(kind)
    options = icl.ICLOptions(tasks=("keywords-2",), demos=(0, 2, 64), test_items=4, orders=2, data=str(path))
    result = icl.run(mut, options, TEXT, progress=False)
    assert set(result["tasks"]) == {"keywords-2", "user"}
    task = result["tasks"]["keywords-2"]
    assert [c["demos"] for c in task["curve"]] == [0, 2, 64]
    assert task["curve"][2]["accuracy"] is None  # 64 demonstrations do not fit 256 bytes
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in task["curve"][:2])
    assert task["robustness"]["demos"] == 2
    for layout in icl.LAYOUTS:
        entry = task["robustness"][layout]
        assert len(entry["accuracies"]) == 2 and entry["spread"] == max(entry["accuracies"]) - min(entry["accuracies"])


@pytest.mark.parametrize("kind", KINDS)
def test_mqar_run_shapes(kind):
    mut = model_under_test(kind, max_seq_len=128)
    options = mqar.MQAROptions(seq_lens=(64, 128, 256), pairs=(4, 16, 32), samples=2)
    result = mqar.run(mut, options, TEXT, progress=False)
    cells = [(c["seq_len"], c["pairs"]) for c in result["cells"]]
    assert cells == [(64, 4), (128, 4), (128, 16)]  # 256 > context; 1 + 4P must fit the length
    assert all(c["queries"] == 2 * c["pairs"] and 0 <= c["accuracy"] <= 1 for c in result["cells"])
