"""Generated examples (key-information retrieval, associative recall, in-context classification)
that the training data mixture can interleave with corpus text, and that the evaluation suite scores.

A generator takes a seeded ``random.Random``, the tokenizer, the number of positions ``length``
and a ``filler(rng, n) -> n corpus tokens`` callable, and returns ``(tokens, loss_mask)``:
``length + 1`` token ids (inputs are tokens[:-1], targets tokens[1:]) and either None (every
target counts) or ``length`` booleans, True where the target counts in the loss.

Registered generators (``GENERATORS``; a training config mixes them with ``data.mix``):

    needle  multi-needle retrieval: a haystack of corpus text holding N needles
            "The magic number of CITY is NUMBER.", a question about R of the cities and the
            answers; only the answer numbers count in the loss (paper Table 2, Fig. 5).
    mqar    multi-query associative recall (Zoology): key-value pairs, then the keys again at
            power-law distributed distances; only the recalled values count in the loss.
    icl     in-context classification episodes "Input: ...\\nLabel: ...": a fresh random
            keyword -> label mapping per episode, so only the context can tell the label;
            only the label tokens count in the loss.

The same builders (:func:`build_needle_example`, :func:`build_mqar_example`,
:func:`keyword_task`, :func:`format_demonstration`) make the evaluation suite's test items, so
training and evaluation see exactly the same format.

The retrieval experiment's tasks on a small symbolic vocabulary (:class:`SymbolicTask`:
:func:`symbolic_needle`, :func:`symbolic_mqar`, :func:`symbolic_batch`) are here too: the same two
skills without a corpus, learnt by a 2-layer model in about a minute. So is the grounded task of
the contextual-hallucination experiment (:class:`GroundedTask`: :func:`memorised_facts`,
:func:`grounded_episode`, :func:`closed_book_example`): facts learnt from training text, then
questions answered from a document that agrees with them, contradicts them or lacks the fact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..loss import IGNORE_INDEX

Filler = Callable[[random.Random, int], list[int]]


class ExampleGenerator(Protocol):
    def __call__(
        self, rng: random.Random, tokenizer, length: int, filler: Filler
    ) -> tuple[list[int], list[bool] | None]: ...


GENERATORS: dict[str, ExampleGenerator] = {}


def register(name: str) -> Callable[[ExampleGenerator], ExampleGenerator]:
    def add(generator: ExampleGenerator) -> ExampleGenerator:
        GENERATORS[name] = generator
        return generator

    return add


def _loss_mask(n_tokens: int, scored_spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Targets mask (n_tokens - 1) that is True where tokens[start:end] of a span are targets."""
    mask = [False] * (n_tokens - 1)
    for start, end in scored_spans:
        for position in range(start, end):
            mask[position - 1] = True  # token at `position` is the target of input position - 1
    return mask


def _with_prefix(rng: random.Random, filler: Filler, body: list[int], length: int) -> tuple[list[int], int]:
    """Corpus text in front of ``body`` so that the whole is ``length + 1`` tokens; returns (tokens, offset)."""
    pad = length + 1 - len(body)
    if pad < 0:
        raise ValueError(f"generated example of {len(body)} tokens does not fit {length + 1}")
    return (filler(rng, pad) if pad else []) + body, pad


# --- multi-needle retrieval ----------------------------------------------------------------------

CITIES = (
    "Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Rome", "Berlin", "Vienna",
    "Dublin", "Lisbon", "Athens", "Moscow", "Delhi", "Seoul", "Bangkok", "Sydney", "Toronto",
    "Chicago", "Boston", "Denver", "Dallas", "Miami", "Havana", "Bogota", "Quito", "Santiago",
    "Nairobi", "Lagos", "Accra", "Dakar", "Tunis", "Algiers", "Baghdad", "Tehran", "Kabul",
    "Karachi", "Dhaka", "Hanoi", "Manila", "Jakarta", "Beijing", "Shanghai", "Osaka", "Prague",
    "Warsaw", "Budapest", "Helsinki", "Stockholm", "Geneva", "Zurich", "Munich", "Hamburg",
    "Venice", "Florence", "Naples", "Seville", "Porto", "Edinburgh",
)
MAX_NEEDLES = 6  # the paper's largest N in Table 2
MAX_QUERIES = 2  # the paper's largest R in Table 2


@dataclass
class NeedleExample:
    """One retrieval document, answers included (teacher forcing), with the spans the evaluations need.

    ``tokens`` = [eos] + haystack + question + answers. Spans are [start, end) token positions.
    The prompt for query r is ``tokens[:answer_spans[r][0]]``; its answer text is ``answers[r]``.
    """

    tokens: list[int]
    answers: list[str]  # the queried numbers, in query order
    answer_spans: list[tuple[int, int]]  # the answer number tokens after "... of CITY is"
    needle_spans: list[tuple[int, int]]  # every needle sentence in the haystack (needle 0 is the target)
    needle_number_spans: list[tuple[int, int]]  # the number inside each needle sentence
    queried_needles: list[int]  # index into needle_spans of the needle each query asks about
    target_needle: int  # the needle placed at ``depth``
    question_start: int  # first token after the haystack
    depth: float


def _needle_pieces(tokenizer, city: str, number: str) -> tuple[list[int], list[int], list[int]]:
    """The sentence " The magic number of CITY is NUMBER." as (lead, number, full stop) tokens."""
    return (
        tokenizer.encode(f" The magic number of {city} is"),
        tokenizer.encode(f" {number}"),
        tokenizer.encode("."),
    )


def _question_text(cities: Sequence[str]) -> str:
    if len(cities) == 1:
        return f"\nQuestion: what is the magic number of {cities[0]}?\nAnswer:"
    listed = ", ".join(cities[:-1]) + f" and {cities[-1]}"
    return f"\nQuestion: what are the magic numbers of {listed}?\nAnswer:"


@dataclass
class _NeedlePlan:
    """The sampled content of a needle document, before the filler is laid around it."""

    numbers: list[str]
    pieces: list[tuple[list[int], list[int], list[int]]]  # per needle: lead, number, full stop
    queried: list[int]
    question: list[int]

    @property
    def fixed_length(self) -> int:
        """Tokens besides the filler: eos, needles, question, answers."""
        needles = sum(_piece_len(p) for p in self.pieces)
        answers = sum(_piece_len(self.pieces[i]) for i in self.queried)
        return 1 + needles + len(self.question) + answers


def _plan_needles(rng: random.Random, tokenizer, n_needles: int, n_queries: int, digits: int) -> _NeedlePlan:
    if not 1 <= n_queries <= n_needles <= len(CITIES):
        raise ValueError(f"need 1 <= n_queries ({n_queries}) <= n_needles ({n_needles}) <= {len(CITIES)}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    cities = rng.sample(CITIES, n_needles)
    numbers = [str(n) for n in rng.sample(range(10 ** (digits - 1), 10**digits), n_needles)]
    queried = [0] + rng.sample(range(1, n_needles), n_queries - 1)  # needle 0 is the target
    rng.shuffle(queried)
    return _NeedlePlan(
        numbers=numbers,
        pieces=[_needle_pieces(tokenizer, c, n) for c, n in zip(cities, numbers)],
        queried=queried,
        question=tokenizer.encode(_question_text([cities[i] for i in queried])),
    )


def _piece_len(pieces: tuple[list[int], ...]) -> int:
    return sum(len(p) for p in pieces)


def _assemble_needles(
    rng: random.Random, tokenizer, filler: Filler, plan: _NeedlePlan, length: int, depth: float
) -> NeedleExample:
    n_filler = length - plan.fixed_length
    if n_filler < 0:
        raise ValueError(
            f"a needle document with {len(plan.pieces)} needles and {len(plan.queried)} queries needs at "
            f"least {plan.fixed_length} tokens with this tokenizer; got length={length}"
        )
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    n_needles = len(plan.pieces)
    # Insertion points into the filler: the target (needle 0) at `depth`, the others anywhere.
    points = [round(depth * n_filler)] + [rng.randint(0, n_filler) for _ in range(n_needles - 1)]
    hay_filler = filler(rng, n_filler) if n_filler else []
    if len(hay_filler) != n_filler:
        raise ValueError(f"filler returned {len(hay_filler)} tokens, {n_filler} were asked for")
    tokens = [tokenizer.eos_id]
    needle_spans: list[tuple[int, int]] = [(0, 0)] * n_needles
    number_spans: list[tuple[int, int]] = [(0, 0)] * n_needles
    consumed = 0
    for i in sorted(range(n_needles), key=lambda i: (points[i], i)):
        tokens += hay_filler[consumed : points[i]]
        consumed = points[i]
        lead, number, stop = plan.pieces[i]
        start = len(tokens)
        tokens += lead + number + stop
        needle_spans[i] = (start, len(tokens))
        number_spans[i] = (start + len(lead), start + len(lead) + len(number))
    tokens += hay_filler[consumed:]
    question_start = len(tokens)
    tokens += plan.question
    answer_spans = []
    for i in plan.queried:
        lead, number, stop = plan.pieces[i]
        tokens += lead
        answer_spans.append((len(tokens), len(tokens) + len(number)))
        tokens += number + stop
    return NeedleExample(
        tokens=tokens,
        answers=[plan.numbers[i] for i in plan.queried],
        answer_spans=answer_spans,
        needle_spans=needle_spans,
        needle_number_spans=number_spans,
        queried_needles=list(plan.queried),
        target_needle=0,
        question_start=question_start,
        depth=depth,
    )


def build_needle_example(
    rng: random.Random,
    tokenizer,
    filler: Filler,
    *,
    length: int,
    n_needles: int,
    n_queries: int,
    depth: float,
    digits: int = 4,
) -> NeedleExample:
    """A document of exactly ``length`` tokens: haystack with ``n_needles`` needles, the target one at
    ``depth`` (0 = right after the start, 1 = right before the question), then a question about
    ``n_queries`` cities (the target's among them, in random order) and their answers.
    """
    plan = _plan_needles(rng, tokenizer, n_needles, n_queries, digits)
    return _assemble_needles(rng, tokenizer, filler, plan, length, depth)


@register("needle")
def needle_generator(rng: random.Random, tokenizer, length: int, filler: Filler) -> tuple[list[int], list[bool]]:
    """Training example: corpus text, then a needle document of random size (N <= 6 needles,
    R <= 2 queries, target at a random depth) ending the sequence; loss on the answer numbers.
    N shrinks until the document fits."""
    n_needles = rng.randint(1, MAX_NEEDLES)
    while True:
        plan = _plan_needles(rng, tokenizer, n_needles, rng.randint(1, min(MAX_QUERIES, n_needles)), digits=4)
        if plan.fixed_length <= length + 1 or n_needles == 1:
            break
        n_needles -= 1
    doc_length = rng.randint(plan.fixed_length, max(plan.fixed_length, length + 1))
    example = _assemble_needles(rng, tokenizer, filler, plan, doc_length, depth=rng.random())
    tokens, offset = _with_prefix(rng, filler, example.tokens, length)
    return tokens, _loss_mask(len(tokens), [(s + offset, e + offset) for s, e in example.answer_spans])


# --- multi-query associative recall (Zoology) ---------------------------------------------------

MQAR_PAIR_COUNTS = (4, 8, 16, 32, 64)
MQAR_POWER_A = 0.01  # Zoology's default: query distances drawn with p(gap slot i) ∝ i^(a - 1)


@dataclass
class MQARExample:
    """[eos] k1 v1 ... kP vP, then each key once more (at power-law distances) followed by its
    value, gap tokens elsewhere. ``value_positions`` are the token positions to recall."""

    tokens: list[int]
    value_positions: list[int]


def mqar_vocabulary(tokenizer) -> tuple[list[int], list[int], int]:
    """Keys (the lower half of the usable ids), values (the upper half) and the gap token ("\\n")."""
    gap = tokenizer.encode("\n")[0]
    usable = [i for i in range(tokenizer.vocab_size) if i not in (tokenizer.eos_id, gap)]
    half = len(usable) // 2
    return usable[:half], usable[half:], gap


def build_mqar_example(
    rng: random.Random, tokenizer, *, length: int, n_pairs: int, power_a: float = MQAR_POWER_A
) -> MQARExample:
    """One MQAR sequence of exactly ``length`` tokens holding ``n_pairs`` key-value pairs."""
    keys, values, gap = mqar_vocabulary(tokenizer)
    if n_pairs < 1 or n_pairs > min(len(keys), len(values)):
        raise ValueError(f"n_pairs must be in [1, {min(len(keys), len(values))}], got {n_pairs}")
    region = length - 1 - 2 * n_pairs  # room for the queries after [eos] and the pairs
    slots = region // 2  # a query takes two positions: the key, then its value
    if slots < n_pairs:
        raise ValueError(f"MQAR with {n_pairs} pairs needs length >= {1 + 4 * n_pairs}, got {length}")
    pair_keys = rng.sample(keys, n_pairs)
    pair_values = [rng.choice(values) for _ in range(n_pairs)]
    tokens = [tokenizer.eos_id]
    for k, v in zip(pair_keys, pair_values):
        tokens += [k, v]
    query_start = len(tokens)
    tokens += [gap] * (length - query_start)
    # Weighted sampling without replacement (Efraimidis-Spirakis): the largest u^(1/w) win.
    weights = [(i + 1) ** (power_a - 1) for i in range(slots)]
    chosen = sorted(range(slots), key=lambda i: rng.random() ** (1.0 / weights[i]), reverse=True)[:n_pairs]
    order = rng.sample(range(n_pairs), n_pairs)  # which key goes to which chosen slot
    value_positions = []
    for slot, pair in zip(sorted(chosen), order):
        position = query_start + 2 * slot
        tokens[position] = pair_keys[pair]
        tokens[position + 1] = pair_values[pair]
        value_positions.append(position + 1)
    return MQARExample(tokens=tokens, value_positions=value_positions)


@register("mqar")
def mqar_generator(rng: random.Random, tokenizer, length: int, filler: Filler) -> tuple[list[int], list[bool]]:
    """Training example: one MQAR sequence filling all ``length + 1`` tokens, with a pair count drawn
    from 4..64 among those that fit; loss on the recalled values only. ``filler`` is unused."""
    fitting = [p for p in MQAR_PAIR_COUNTS if 1 + 4 * p <= length + 1] or [max(1, length // 4)]
    example = build_mqar_example(rng, tokenizer, length=length + 1, n_pairs=rng.choice(fitting))
    return example.tokens, _loss_mask(len(example.tokens), [(p, p + 1) for p in example.value_positions])


# --- in-context classification ---------------------------------------------------------------------

ICL_WORDS = (
    "apple", "river", "stone", "cloud", "horse", "bread", "chair", "garden", "window", "candle",
    "forest", "bridge", "letter", "mirror", "basket", "castle", "needle", "pillow", "hammer", "lantern",
    "meadow", "island", "feather", "button", "carpet", "ladder", "saddle", "kettle", "anchor", "barrel",
    "cottage", "harbor", "orchard", "valley", "thunder", "ribbon", "violin", "wagon", "marble", "copper",
    "silver", "timber", "pepper", "honey", "cheese", "butter", "lemon", "cherry", "walnut", "acorn",
    "falcon", "rabbit", "salmon", "turtle", "spider", "beetle", "badger", "otter", "raven", "sparrow",
    "tailor", "farmer", "sailor", "doctor", "bishop", "knight", "soldier", "painter", "miller", "baker",
    "engine", "rocket", "magnet", "pencil", "ticket", "wallet", "jacket", "helmet", "blanket", "bottle",
    "desert", "glacier", "canyon", "volcano", "prairie", "swamp", "jungle", "tundra", "lagoon", "cavern",
    "winter", "summer", "autumn", "spring", "morning", "evening", "midnight", "season", "moment", "decade",
)
LABEL_WORDS = (
    "red", "blue", "green", "gold", "black", "white", "north", "south", "east", "west", "yes", "no",
    "good", "bad", "high", "low", "hot", "cold", "left", "right", "old", "new", "fast", "slow",
    "king", "queen", "day", "night", "land", "sea",
)


@dataclass
class ClassificationTask:
    """Labelled texts; ``items`` are (text, label index) pairs, ``labels`` the label words."""

    name: str
    labels: list[str]
    items: list[tuple[str, int]]


def keyword_task(
    rng: random.Random,
    *,
    n_classes: int,
    n_items: int,
    keywords_per_class: int = 2,
    words_per_input: int = 4,
    name: str = "keywords",
) -> ClassificationTask:
    """A classification task whose label is set by which keyword an input holds.

    Every class gets ``keywords_per_class`` keywords and a label word, all drawn at random, so the
    keyword -> label mapping can only be learnt from the demonstrations in the context. An input
    is one keyword among ``words_per_input - 1`` distractor words (never keywords).
    """
    if not 2 <= n_classes <= len(LABEL_WORDS):
        raise ValueError(f"n_classes must be in [2, {len(LABEL_WORDS)}], got {n_classes}")
    n_keywords = n_classes * keywords_per_class
    if keywords_per_class < 1 or words_per_input < 1 or n_keywords + words_per_input - 1 > len(ICL_WORDS):
        raise ValueError(
            f"{n_classes} classes x {keywords_per_class} keywords + {words_per_input - 1} distractors "
            f"need more than the {len(ICL_WORDS)} words available"
        )
    words = rng.sample(ICL_WORDS, len(ICL_WORDS))
    keywords, distractors = words[:n_keywords], words[n_keywords:]
    labels = rng.sample(LABEL_WORDS, n_classes)
    items = []
    for _ in range(n_items):
        label = rng.randrange(n_classes)
        keyword = keywords[label * keywords_per_class + rng.randrange(keywords_per_class)]
        text = rng.sample(distractors, words_per_input - 1)
        text.insert(rng.randint(0, len(text)), keyword)
        items.append((" ".join(text), label))
    return ClassificationTask(name=name, labels=labels, items=items)


def encode_query(tokenizer, text: str) -> list[int]:
    """Tokens of "Input: TEXT\\nLabel:"; a label continuation follows (see :func:`encode_label`)."""
    return tokenizer.encode(f"Input: {text}\nLabel:")


def encode_label(tokenizer, label: str) -> list[int]:
    """Tokens of " LABEL", the continuation scored by constrained decoding."""
    return tokenizer.encode(f" {label}")


def encode_demonstration(tokenizer, text: str, label: str) -> list[int]:
    """Query + label + newline, encoded piece by piece exactly as they are scored."""
    return encode_query(tokenizer, text) + encode_label(tokenizer, label) + tokenizer.encode("\n")


@register("icl")
def icl_generator(rng: random.Random, tokenizer, length: int, filler: Filler) -> tuple[list[int], list[bool]]:
    """Training example: [eos] then demonstrations of one fresh keyword task (2-8 classes) until the
    sequence is full, corpus text in front for the remainder; loss on the label tokens."""
    task = keyword_task(rng, n_classes=rng.randint(2, 8), n_items=length)
    body = [tokenizer.eos_id]
    label_spans = []
    for text, label in task.items:
        query = encode_query(tokenizer, text)
        answer = encode_label(tokenizer, task.labels[label])
        newline = tokenizer.encode("\n")
        if len(body) + len(query) + len(answer) + len(newline) > length + 1:
            break
        body += query
        label_spans.append((len(body), len(body) + len(answer)))
        body += answer + newline
    tokens, offset = _with_prefix(rng, filler, body, length)
    return tokens, _loss_mask(len(tokens), [(s + offset, e + offset) for s, e in label_spans])


# --- symbolic retrieval (the retrieval experiment's small vocabulary) ------------------------------------
#
#   needle   BOS noise … NEEDLE k₁ v₁ … noise … NEEDLE k₂ v₂ … noise … QUERY kᵢ → vᵢ
#            N needles (N − 1 distractors with other keys) among random noise tokens; the
#            queried needle sits at a chosen depth; one answer token is scored.
#   mqar     BOS k₁ v₁ k₂ v₂ … k_D v_D noise … kₐ → vₐ  k_b → v_b …
#            multi-query associative recall: D pairs, then several of their keys again;
#            every value after a repeated key is scored.

# Token layout of the symbolic vocabulary: markers, then keys, values and noise tokens.
BOS, NEEDLE, QUERY = 0, 1, 2
FIRST_KEY = 4  # 4 markers: BOS, NEEDLE, QUERY and one spare


@dataclass(frozen=True)
class SymbolicTask:
    """The vocabulary and length of the symbolic retrieval examples: ``length`` tokens of model input
    per example, ``keys``, ``values`` and ``noise_tokens`` distinct tokens; ``queries`` MQAR keys
    asked again per example (None: every pair, in a random order)."""

    length: int
    keys: int
    values: int
    noise_tokens: int
    queries: int | None = None

    @property
    def vocab_size(self) -> int:
        return FIRST_KEY + self.keys + self.values + self.noise_tokens

    @property
    def key_tokens(self) -> range:
        return range(FIRST_KEY, FIRST_KEY + self.keys)

    @property
    def value_tokens(self) -> range:
        return range(FIRST_KEY + self.keys, FIRST_KEY + self.keys + self.values)

    @property
    def noise(self) -> range:
        return range(self.value_tokens.stop, self.value_tokens.stop + self.noise_tokens)


@dataclass
class SymbolicExample:
    """One generated example: ``tokens`` (length + 1), and the positions (in the model's input,
    i.e. predicting tokens[pos + 1]) whose next token is scored."""

    tokens: list[int]
    answer_positions: list[int]
    answer_span: tuple[int, int] = (0, 0)  # needle: [start, end) of the queried needle's tokens
    query_start: int = 0  # needle: where the query begins


def symbolic_needle(rng: random.Random, task: SymbolicTask, n_needles: int, depth: float) -> SymbolicExample:
    """BOS, noise with ``n_needles`` (NEEDLE key value) triples, then QUERY key → value.

    The queried needle starts at ``depth`` of the body (0 = first, 1 = last possible slot);
    the distractors take random free slots, keys are distinct.
    """
    body = task.length - 2  # tokens[0] = BOS; the query's two tokens and the answer close the example
    n_body = body - 1
    keys = rng.sample(task.key_tokens, n_needles)
    values = [rng.choice(task.value_tokens) for _ in keys]
    slots = n_body - 3 * n_needles  # noise tokens
    # Place needles as items among noise: the queried one at the position matching depth.
    queried = round(depth * slots)
    others = sorted(rng.randint(0, slots) for _ in range(n_needles - 1))
    starts_in_noise = sorted([(queried, 0)] + [(p, i + 1) for i, p in enumerate(others)])
    tokens = [BOS]
    span = (0, 0)
    noise_used = 0
    for position, index in starts_in_noise:
        tokens += [rng.choice(task.noise) for _ in range(position - noise_used)]
        noise_used = position
        if index == 0:
            span = (len(tokens), len(tokens) + 3)
        tokens += [NEEDLE, keys[index], values[index]]
    tokens += [rng.choice(task.noise) for _ in range(slots - noise_used)]
    query_start = len(tokens)
    tokens += [QUERY, keys[0], values[0]]
    assert len(tokens) == task.length + 1
    return SymbolicExample(tokens, [task.length - 1], span, query_start)


def symbolic_mqar(rng: random.Random, task: SymbolicTask, n_pairs: int) -> SymbolicExample:
    """BOS, ``n_pairs`` key-value pairs, noise, then ``task.queries`` of the keys again (default: all,
    shuffled), each followed by its value (scored)."""
    keys = rng.sample(task.key_tokens, n_pairs)
    values = [rng.choice(task.value_tokens) for _ in keys]
    tokens = [BOS]
    for k, v in zip(keys, values):
        tokens += [k, v]
    asked = rng.sample(range(n_pairs), task.queries or n_pairs)
    gap = task.length + 1 - len(tokens) - 2 * len(asked)
    tokens += [rng.choice(task.noise) for _ in range(gap)]
    positions = []
    for i in asked:
        tokens += [keys[i], values[i]]
        positions.append(len(tokens) - 2)  # the key's position predicts the value
    assert len(tokens) == task.length + 1
    return SymbolicExample(tokens, positions)


class ScoredExample(Protocol):
    """A generated example: its tokens (length + 1) and the input positions whose next token is scored."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def answer_positions(self) -> list[int]: ...


def symbolic_batch(examples: Sequence[ScoredExample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, length); targets are -100 (not counted) except at the answers."""
    tokens = torch.tensor([e.tokens for e in examples])
    inputs = tokens[:, :-1]
    targets = torch.full_like(inputs, IGNORE_INDEX)
    for row, example in enumerate(examples):
        for position in example.answer_positions:
            targets[row, position] = tokens[row, position + 1]
    return inputs, targets


# --- grounded question answering (the contextual-hallucination experiment) --------------------------
#
#   training text   BOS ASK e₁ a₁ ASK e₂ a₂ …                    closed book: each entity's memorised
#                                                                attribute (the same table throughout)
#   episode         BOS DOC … e₁ a₁ … e₂ a₂ … ASK e → a  ASK e′ → a′ …
#                   a document of facts "e a" among noise tokens, then questions; the answer is the
#                   document's attribute of e (which agrees with the memorised one, or contradicts
#                   it: counterfactual), or UNKNOWN when the document does not state e.
#
# Its own vocabulary: four markers, then entities, attributes and noise tokens.
DOCUMENT, ASK, UNKNOWN = 1, 2, 3  # with BOS = 0; FIRST_KEY (4) is the first entity
CONDITIONS = ("agree", "counterfactual", "lacking")  # how an episode's question relates to its document
CLOSED_BOOK = "closed_book"  # a question of the training text: no document, the memorised attribute


@dataclass(frozen=True)
class GroundedTask:
    """The grounded task's vocabulary and sizes: ``length`` tokens of model input per example;
    ``entities`` with a memorised attribute each, among ``attributes``; ``noise_tokens`` filler.
    An episode's document states ``context_facts`` facts, each agreeing with memory with probability
    ``agree_share`` (else a different attribute); then ``questions`` questions, each about an entity of
    the document with probability ``answerable_share`` (else about one it lacks)."""

    length: int
    entities: int
    attributes: int
    noise_tokens: int
    context_facts: int
    questions: int
    agree_share: float
    answerable_share: float

    def __post_init__(self) -> None:
        if self.context_facts + self.questions > self.entities:
            raise ValueError(f"an episode needs context_facts + questions = {self.context_facts + self.questions} "
                             f"distinct entities, the task has {self.entities}")
        if self.questions > self.context_facts:
            raise ValueError(f"questions ({self.questions}) must not exceed context_facts ({self.context_facts}): "
                             "every question may ask about the document")
        if self.attributes < 2:
            raise ValueError(f"a counterfactual needs at least 2 attributes, got {self.attributes}")
        if self.document_noise < 0:
            raise ValueError(f"length {self.length} is too short: BOS, DOC, {self.context_facts} facts and "
                             f"{self.questions} questions take {self.length + 1 - self.document_noise} tokens")
        if self.length < 3:
            raise ValueError(f"length must be at least 3 (one closed-book question), got {self.length}")

    @property
    def vocab_size(self) -> int:
        return FIRST_KEY + self.entities + self.attributes + self.noise_tokens

    @property
    def entity_tokens(self) -> range:
        return range(FIRST_KEY, FIRST_KEY + self.entities)

    @property
    def attribute_tokens(self) -> range:
        return range(self.entity_tokens.stop, self.entity_tokens.stop + self.attributes)

    @property
    def noise(self) -> range:
        return range(self.attribute_tokens.stop, self.attribute_tokens.stop + self.noise_tokens)

    @property
    def document_noise(self) -> int:
        """Noise tokens in an episode's document: what BOS, DOC, the facts and the questions leave."""
        return self.length + 1 - 2 - 2 * self.context_facts - 3 * self.questions

    @property
    def closed_book_questions(self) -> int:
        """Questions of one closed-book example (distinct entities)."""
        return min(self.entities, self.length // 3)


@dataclass(frozen=True)
class GroundedQuestion:
    """One scored question: ``position`` is the input position that predicts the answer (the
    entity's, after ``marker``, the position of its ASK); the entity's ``memorised`` attribute and
    the ``document``'s (None where it lacks the entity, or there is no document); ``target`` is
    what the model is taught; ``stated`` every attribute the document states (any entity)."""

    position: int
    marker: int
    condition: str  # one of CONDITIONS, or CLOSED_BOOK
    entity: int
    memorised: int
    document: int | None
    target: int
    stated: tuple[int, ...] = ()


@dataclass
class GroundedExample:
    tokens: list[int]
    questions: list[GroundedQuestion]

    @property
    def answer_positions(self) -> list[int]:
        return [q.position for q in self.questions]


def memorised_facts(task: GroundedTask, seed: int) -> tuple[int, ...]:
    """The attribute token each entity is taught in the training text (entity i: ``facts[i]``), drawn
    once from ``seed``: the same for every model, step and evaluation."""
    rng = random.Random(f"grounded-facts/{seed}")
    return tuple(rng.choice(task.attribute_tokens) for _ in range(task.entities))


def _draw_conditions(rng: random.Random, task: GroundedTask) -> list[str]:
    conditions = []
    for _ in range(task.questions):
        if rng.random() < task.answerable_share:
            conditions.append("agree" if rng.random() < task.agree_share else "counterfactual")
        else:
            conditions.append("lacking")
    return conditions


def grounded_episode(rng: random.Random, task: GroundedTask, facts: Sequence[int],
                     conditions: Sequence[str] | None = None) -> GroundedExample:
    """BOS DOC, a document of ``task.context_facts`` facts "e a" at random places among noise, then
    one question "ASK e a" per condition (default: drawn from the task's shares): ``agree`` asks an
    entity the document states with its memorised attribute, ``counterfactual`` one it states with
    another attribute, ``lacking`` one it does not state (answer UNKNOWN). Entities are distinct; the
    document's facts nobody asks about agree with memory with probability ``task.agree_share``."""
    conditions = list(conditions) if conditions is not None else _draw_conditions(rng, task)
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or len(conditions) != task.questions:
        raise ValueError(f"need {task.questions} conditions among {CONDITIONS}, got {conditions}")
    answerable = [c for c in conditions if c != "lacking"]
    chosen = rng.sample(task.entity_tokens, task.context_facts + len(conditions) - len(answerable))
    stated_entities, absent = chosen[: task.context_facts], chosen[task.context_facts:]
    memorised = {e: facts[e - FIRST_KEY] for e in chosen}

    def contradicting(entity: int) -> int:
        return rng.choice([a for a in task.attribute_tokens if a != memorised[entity]])

    document = {}
    for i, entity in enumerate(stated_entities):  # the first len(answerable) are the ones asked about
        agrees = answerable[i] == "agree" if i < len(answerable) else rng.random() < task.agree_share
        document[entity] = memorised[entity] if agrees else contradicting(entity)
    asked_stated, asked_absent = iter(stated_entities[: len(answerable)]), iter(absent)
    asked = [next(asked_absent) if c == "lacking" else next(asked_stated) for c in conditions]
    order = rng.sample(stated_entities, len(stated_entities))  # where each fact sits in the document
    gaps = sorted(rng.randint(0, task.document_noise) for _ in order)  # noise before each fact
    tokens, used = [BOS, DOCUMENT], 0
    for gap, entity in zip(gaps, order):
        tokens += [rng.choice(task.noise) for _ in range(gap - used)]
        used = gap
        tokens += [entity, document[entity]]
    tokens += [rng.choice(task.noise) for _ in range(task.document_noise - used)]
    stated = tuple(document[e] for e in order)
    questions = []
    for condition, entity in zip(conditions, asked):
        target = document.get(entity, UNKNOWN)
        questions.append(GroundedQuestion(len(tokens) + 1, len(tokens), condition, entity, memorised[entity],
                                          document.get(entity), target, stated))
        tokens += [ASK, entity, target]
    assert len(tokens) == task.length + 1
    return GroundedExample(tokens, questions)


def closed_book_example(rng: random.Random, task: GroundedTask, facts: Sequence[int],
                        entities: Sequence[int] | None = None) -> GroundedExample:
    """The training text of the facts: BOS, then "ASK e a" for distinct entities (default: a random
    ``task.closed_book_questions`` of them; else ``entities``, as many as fit), each answer the
    memorised attribute, noise tokens after. No document: memory is the only source."""
    entities = list(entities) if entities is not None else rng.sample(task.entity_tokens, task.closed_book_questions)
    if not 1 <= len(entities) <= task.closed_book_questions:
        raise ValueError(f"a closed-book example holds 1 to {task.closed_book_questions} questions, "
                         f"got {len(entities)}")
    tokens, questions = [BOS], []
    for entity in entities:
        answer = facts[entity - FIRST_KEY]
        questions.append(GroundedQuestion(len(tokens) + 1, len(tokens), CLOSED_BOOK, entity, answer, None, answer))
        tokens += [ASK, entity, answer]
    tokens += [rng.choice(task.noise) for _ in range(task.length + 1 - len(tokens))]
    return GroundedExample(tokens, questions)
