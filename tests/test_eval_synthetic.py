"""The generated examples the training mixture and the evaluation suite share (data/synthetic.py)."""

import random

import pytest

from diff_transformer.data.synthetic import (
    CITIES,
    GENERATORS,
    build_mqar_example,
    build_needle_example,
    encode_label,
    keyword_task,
    mqar_vocabulary,
)
from diff_transformer.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def filler(rng: random.Random, n: int) -> list[int]:
    return [ord("x")] * n  # a filler that is easy to tell apart from needles


@pytest.mark.parametrize("name", ["needle", "mqar", "icl"])
@pytest.mark.parametrize("length", [300, 512])
def test_generators_follow_the_protocol(name, length):
    for seed in range(5):
        tokens, mask = GENERATORS[name](random.Random(seed), TOK, length, filler)
        assert len(tokens) == length + 1
        assert mask is not None and len(mask) == length and any(mask)
        assert all(0 <= t < TOK.vocab_size for t in tokens)


def test_needle_generator_scores_exactly_the_answer_digits():
    for seed in range(10):
        tokens, mask = GENERATORS["needle"](random.Random(seed), TOK, 400, filler)
        text = TOK.decode(tokens)
        scored = TOK.decode([tokens[i + 1] for i in range(400) if mask[i]])
        answers = text.split("Answer:")[1]
        expected = "".join(" " + part.split(" is ")[1].rstrip(".") for part in answers.split(".") if " is " in part)
        assert scored == expected


def test_needle_generator_is_deterministic_given_the_seed():
    assert (GENERATORS["needle"](random.Random(3), TOK, 300, filler)
            == GENERATORS["needle"](random.Random(3), TOK, 300, filler))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_document_layout(depth):
    ex = build_needle_example(random.Random(1), TOK, filler, length=300, n_needles=3, n_queries=2, depth=depth)
    assert len(ex.tokens) == 300 and ex.tokens[0] == TOK.eos_id
    target_start, target_end = ex.needle_spans[ex.target_needle]
    n_filler = 300 - sum(e - s for s, e in ex.needle_spans) - (300 - ex.question_start) - 1
    filler_before = sum(1 for t in ex.tokens[1:target_start] if t == ord("x"))
    assert filler_before == round(depth * n_filler)
    assert ex.target_needle in ex.queried_needles and len(ex.answers) == 2
    for (start, end), answer in zip(ex.answer_spans, ex.answers):
        assert TOK.decode(ex.tokens[start:end]) == f" {answer}"
        assert TOK.decode(ex.tokens[:start]).endswith(" is")
    for i, (start, end) in enumerate(ex.needle_number_spans):
        assert ex.needle_spans[i][0] < start < end < ex.needle_spans[i][1]
        assert TOK.decode(ex.tokens[ex.needle_spans[i][0] : ex.needle_spans[i][1]]).startswith(" The magic number of ")
    assert any(TOK.decode(ex.tokens).count(city) for city in CITIES)


def test_needle_document_too_short_is_a_clear_error():
    with pytest.raises(ValueError, match="needs at least"):
        build_needle_example(random.Random(0), TOK, filler, length=50, n_needles=2, n_queries=1, depth=0.5)


def test_mqar_example_recalls_each_key_once():
    keys, values, gap = mqar_vocabulary(TOK)
    assert not set(keys) & set(values) and gap not in keys + values and TOK.eos_id not in keys + values
    ex = build_mqar_example(random.Random(0), TOK, length=129, n_pairs=16)
    assert len(ex.tokens) == 129 and ex.tokens[0] == TOK.eos_id
    pairs = dict(zip(ex.tokens[1:33:2], ex.tokens[2:33:2]))
    assert len(pairs) == 16 and set(pairs) <= set(keys) and set(pairs.values()) <= set(values)
    queried = [ex.tokens[p - 1] for p in ex.value_positions]
    assert sorted(queried) == sorted(pairs)
    assert all(ex.tokens[p] == pairs[ex.tokens[p - 1]] for p in ex.value_positions)
    assert all(p > 32 for p in ex.value_positions)
    with pytest.raises(ValueError, match="needs length"):
        build_mqar_example(random.Random(0), TOK, length=60, n_pairs=16)


def test_mqar_queries_lean_towards_short_distances():
    """Zoology's power law: most queries right after the pairs, few at the far end."""
    near = far = 0
    for seed in range(50):
        ex = build_mqar_example(random.Random(seed), TOK, length=257, n_pairs=8)
        for p in ex.value_positions:
            near += p < 17 + 60
            far += p >= 257 - 60
    assert near > 2 * far


def test_keyword_task_is_consistent_and_solvable_from_context():
    task = keyword_task(random.Random(0), n_classes=4, n_items=200)
    assert len(set(task.labels)) == 4
    labels_of: dict[str, set[int]] = {}
    for text, label in task.items:
        assert len(text.split()) == 4
        for word in text.split():
            labels_of.setdefault(word, set()).add(label)
    # The 4 x 2 keywords always come with their own class's label; every input holds exactly one.
    keywords = {w for w, labels in labels_of.items()
                if len(labels) == 1 and sum(w in t.split() for t, _ in task.items) >= 10}
    assert len(keywords) == 8
    assert all(len(keywords & set(text.split())) == 1 for text, _ in task.items)
    assert encode_label(TOK, task.labels[0]) == TOK.encode(" " + task.labels[0])


def test_icl_generator_scores_only_labels():
    tokens, mask = GENERATORS["icl"](random.Random(0), TOK, 400, filler)
    scored = TOK.decode([tokens[i + 1] for i in range(400) if mask[i]])
    text = TOK.decode(tokens)
    labels = [line.split("Label:")[1] for line in text.split("\n") if line.startswith("Label:")]
    assert scored == "".join(labels)
