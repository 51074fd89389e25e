"""What every evaluation shares: loading a checkpoint, held-out text, batched scoring, the
option dataclasses that become command-line flags, output files and plots.

An evaluation module defines ``SPEC = Evaluation(...)``: its name, the paper figure it
reproduces, an ``Options`` dataclass (each field one ``--flag``, its help in the field metadata,
``Options.quick()`` a small budget for tests), ``run(model, options, text) -> dict`` for one
model, ``plot(results, options, path)`` and ``report(results, options) -> Markdown`` for all models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..files import write_atomically, write_text_atomically
from ..model import LanguageModel

DEFAULT_OUT = Path("out/eval")
BASELINE = "standard"  # the paper's "Transformer"
DIFF_KINDS = ("diff", "diff_v2")


# --- models ----------------------------------------------------------------------------------------


@dataclass
class ModelUnderTest:
    """A model, its tokenizer, and a short label for tables and plots."""

    label: str
    model: LanguageModel
    tokenizer: Any
    checkpoint: str | None = None

    @property
    def attention(self) -> str:
        return self.model.config.attention

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def describe(self) -> dict[str, Any]:
        with torch.no_grad():
            lambdas = self.model.lambdas()
        return {
            "checkpoint": self.checkpoint,
            "attention": self.attention,
            "parameters": self.model.num_parameters(),
            "max_seq_len": self.max_seq_len,
            "lambdas": [round(x, 4) for x in lambdas],
        }


def load_model(
    checkpoint: str | Path,
    *,
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
    label: str | None = None,
) -> ModelUnderTest:
    """A checkpoint directory (``save_pretrained``) in eval mode with its tokenizer.

    ``tokenizer`` (a tokenizer or a path / "bytes") is needed only if the checkpoint holds none.
    """
    from ..checkpoint import load_checkpoint_tokenizer
    from ..tokenizer import load_tokenizer

    model = LanguageModel.from_pretrained(checkpoint, device=device).eval()
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is None:
        tokenizer = load_checkpoint_tokenizer(checkpoint, model.config.vocab_size)
    if tokenizer is None:
        raise ValueError(f"{checkpoint} holds no tokenizer; pass one (--tokenizer)")
    directory = Path(checkpoint).resolve()
    if directory.name == "checkpoint":  # the trainer's layout: RUN_DIR/checkpoint
        directory = directory.parent
    name = label or f"{model.config.attention}:{directory.name}"
    return ModelUnderTest(label=name, model=model, tokenizer=tokenizer, checkpoint=str(checkpoint))


# --- held-out text -----------------------------------------------------------------------------------


def corpus_validation_texts() -> list[str]:
    """The validation documents of the embedded corpus: the same split as ``default_dataset()``
    (by document, seeded), so models trained on the default data never saw this text."""
    from ..data import corpus_documents
    from ..data.corpus import DEFAULT_SPLIT_SEED
    from ..data.prepare import DEFAULT_VAL_FRACTION, cut_text, plan_split

    documents = [text for _, text in corpus_documents()]
    plan = plan_split([len(t.encode("utf-8")) for t in documents], DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED)
    texts = [documents[i] for i in sorted(plan.val)]
    if plan.cut is not None:
        texts.append(cut_text(documents[plan.cut], plan.cut_bytes)[1])
    return texts


class EvalText:
    """Held-out text (the corpus' validation documents by default), tokenized per tokenizer on demand.

    Documents are joined with the end-of-text token, as in training. ``texts`` replaces the
    corpus (tests, or a user's own text).
    """

    def __init__(self, texts: Sequence[str] | None = None, *, max_chars: int = 4_000_000) -> None:
        self._texts = list(texts) if texts is not None else None
        self.max_chars = max_chars
        self._streams: dict[tuple, Tensor] = {}

    def _load_texts(self) -> list[str]:
        if self._texts is None:
            texts, chars = [], 0
            for text in corpus_validation_texts():
                texts.append(text[: self.max_chars - chars])
                chars += len(texts[-1])
                if chars >= self.max_chars:
                    break
            self._texts = texts
        if not self._texts or not any(t.strip() for t in self._texts):
            raise ValueError("evaluation text is empty")
        return self._texts

    def stream(self, tokenizer, min_tokens: int) -> Tensor:
        """At least ``min_tokens`` token ids (1-D int64) of held-out text, or a clear error."""
        key = (type(tokenizer).__name__, tokenizer.vocab_size, str(getattr(tokenizer, "path", "")))
        cached = self._streams.get(key)
        if cached is None:  # the whole text, once per tokenizer
            ids: list[int] = []
            for text in self._load_texts():
                ids += tokenizer.encode(text) + [tokenizer.eos_id]
            cached = torch.tensor(ids, dtype=torch.long)
            self._streams[key] = cached
        if cached.numel() < min_tokens:
            raise ValueError(
                f"the evaluation text holds {cached.numel()} tokens; this evaluation needs {min_tokens} "
                f"(lower its token budget or give more text)"
            )
        return cached

    def windows(self, tokenizer, length: int, count: int) -> Tensor:
        """``count`` non-overlapping windows of ``length + 1`` tokens, spread evenly over the
        text (so that they sample all of its documents): (count, length + 1)."""
        stream = self.stream(tokenizer, count * (length + 1))
        stride = stream.numel() // count
        starts = torch.arange(count) * stride
        return stream[starts[:, None] + torch.arange(length + 1)]

    def filler(self, tokenizer, min_tokens: int = 4096) -> Callable[[random.Random, int], list[int]]:
        """``filler(rng, n)``: n consecutive tokens from a random place of the text."""
        stream = self.stream(tokenizer, min_tokens).tolist()

        def fill(rng: random.Random, n: int) -> list[int]:
            if n > len(stream):
                raise ValueError(f"filler asked for {n} tokens; the evaluation text holds {len(stream)}")
            start = rng.randrange(len(stream) - n + 1)
            return stream[start : start + n]

        return fill


# --- scoring ------------------------------------------------------------------------------------------


@torch.no_grad()
def token_nll(model: LanguageModel, windows: Tensor, batch_size: int = 8) -> Tensor:
    """Per-token negative log-likelihood (N, T) fp32 of windows (N, T + 1): NLL of windows[:, t+1]."""
    device = model.embed.weight.device
    out = []
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits, _ = model(batch[:, :-1])
        nll = F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="none")
        out.append(nll.cpu())
    return torch.cat(out)


@torch.no_grad()
def score_choices(
    model: LanguageModel,
    prefix: Sequence[int],
    queries: Sequence[Sequence[int]],
    choices: Sequence[Sequence[int]],
    *,
    batch_size: int = 64,
) -> list[list[float]]:
    """``scores[i][c]``: the summed log-probability of ``choices[c]`` after ``prefix + queries[i]``.

    Constrained decoding without re-running shared context: the prefix runs once into a KV cache,
    queries of equal length run together on copies of it, and every choice branches off its
    query's cache (choices of one token need no further pass: the query's last logits score them).
    """
    if not prefix or any(len(q) == 0 for q in queries) or any(len(c) == 0 for c in choices):
        raise ValueError("score_choices needs a non-empty prefix, queries and choices")
    device = model.embed.weight.device
    n_choices, width = len(choices), max(len(c) for c in choices)
    capacity = len(prefix) + max(len(q) for q in queries) + width
    if capacity > model.config.max_seq_len:
        raise ValueError(f"prefix + query + choice ({capacity} tokens) exceeds max_seq_len={model.config.max_seq_len}")
    prefix_cache = model.new_cache(1, capacity)
    model(torch.tensor([list(prefix)], device=device), cache=prefix_cache)
    choice_rows = torch.zeros(n_choices, width, dtype=torch.long, device=device)  # right padding is inert (causal)
    for c, tokens in enumerate(choices):
        choice_rows[c, : len(tokens)] = torch.tensor(list(tokens), device=device)
    scores: list[list[float]] = [[] for _ in queries]
    by_length: dict[int, list[int]] = {}
    for i, q in enumerate(queries):
        by_length.setdefault(len(q), []).append(i)
    per_chunk = max(1, batch_size // n_choices)
    for length, indices in by_length.items():
        for start in range(0, len(indices), per_chunk):
            chunk = indices[start : start + per_chunk]
            b = len(chunk)
            query_cache = prefix_cache.expand(b)
            query_logits, _ = model(torch.tensor([list(queries[i]) for i in chunk], device=device), cache=query_cache)
            rows = choice_rows.repeat(b, 1)  # (b·C, W): query i's choices are rows i·C … i·C + C − 1
            last = query_logits[:, -1:].float().repeat_interleave(n_choices, dim=0)  # predicts each choice's first token
            if width > 1:
                choice_cache = query_cache.expand(n_choices)
                choice_logits, _ = model(rows[:, :-1], cache=choice_cache)
                last = torch.cat([last, choice_logits.float()], dim=1)
            token_logp = last.log_softmax(-1).gather(-1, rows[..., None]).squeeze(-1)  # (b·C, W)
            lengths = torch.tensor([len(c) for c in choices], device=device).repeat(b)
            token_logp = token_logp.masked_fill(torch.arange(width, device=device) >= lengths[:, None], 0.0)
            for j, i in enumerate(chunk):
                scores[i] = token_logp[j * n_choices : (j + 1) * n_choices].sum(-1).tolist()
    return scores


@torch.no_grad()
def score_sequences(
    model: LanguageModel, sequences: Sequence[Sequence[int]], scored_from: Sequence[int], *, batch_size: int = 16
) -> list[float]:
    """Sum of log-probabilities of ``sequence[scored_from:]`` given what precedes it, one full
    forward pass per sequence (batched, right-padded; causal attention makes the padding inert)."""
    device = model.embed.weight.device
    scores: list[float] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        rows = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        for i, seq in enumerate(chunk):
            rows[i, : len(seq)] = torch.tensor(list(seq), device=device)
        logits, _ = model(rows[:, :-1])
        token_logp = logits.float().log_softmax(-1).gather(-1, rows[:, 1:, None]).squeeze(-1)  # (b, W - 1)
        for i, seq in enumerate(chunk):
            first = scored_from[start + i]
            if not 1 <= first < len(seq):
                raise ValueError(f"scored_from={first} must be in [1, {len(seq) - 1}]")
            scores.append(float(token_logp[i, first - 1 : len(seq) - 1].sum()))
    return scores


def greedy_decode(model: LanguageModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[int] = ()) -> list[list[int]]:
    """Greedy continuation of each prompt (temperature 0)."""
    return model.generate([list(p) for p in prompts], max_new_tokens, temperature=0.0, stop_tokens=list(stop))


def windows_fingerprint(windows: Tensor) -> str:
    """A short digest of the token windows, to tell whether two models were scored on the same text."""
    import hashlib

    return hashlib.sha1(windows.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def difference_noise(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    """Two standard errors of mean(b[key]) − mean(a[key]) from per-window values.

    ``a[key]``, ``b[key]`` are per-window lists (None where a window has no value). Paired
    (window by window) when both results carry the same ``windows`` fingerprint, else unpaired.
    """
    xs, ys = a[key], b[key]
    if a.get("windows_fingerprint") is not None and a.get("windows_fingerprint") == b.get("windows_fingerprint"):
        diffs = [y - x for x, y in zip(xs, ys) if x is not None and y is not None]
        return 2 * math.sqrt(_variance(diffs) / len(diffs)) if len(diffs) > 1 else 0.0
    xs, ys = [x for x in xs if x is not None], [y for y in ys if y is not None]
    if len(xs) < 2 or len(ys) < 2:
        return 0.0
    return 2 * math.sqrt(_variance(xs) / len(xs) + _variance(ys) / len(ys))


def _variance(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def seeded_rng(*parts: Any) -> random.Random:
    """A ``random.Random`` seeded from the parts (deterministic across runs and platforms)."""
    return random.Random("/".join(str(p) for p in parts))


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n items."""
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


# --- options: dataclass fields become command-line flags ----------------------------------------------


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with a --help text (``metadata["help"]``); tuples are given as lists."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence options")
    return field(default=default, metadata={"help": help, **metadata})


def _flag_type(f: dataclasses.Field) -> tuple[Callable[[str], Any], bool]:
    """(element type, takes several values) of an option field."""
    explicit = f.metadata.get("type")
    default = f.default
    if isinstance(default, tuple):
        return explicit or (type(default[0]) if default else str), True
    if explicit:
        return explicit, f.metadata.get("nargs") == "+"
    if default is None:
        raise TypeError(f"option {f.name}: give metadata type= for a None default")
    return type(default), False


def _flag_parser(f: dataclasses.Field, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """The argument type of a number flag: an int is at least 1 (0 for a ``seed``) and a float at
    least 0, unless the field's metadata gives ``minimum`` / ``maximum``; a field whose metadata
    gives ``check`` (a function raising ValueError) has each value checked by it."""
    check = f.metadata.get("check")
    if check is not None:
        import argparse

        def checked(value: str):
            converted = kind(value)
            try:
                check(converted)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{value!r} is not valid ({exc})") from None
            return converted

        checked.__name__ = getattr(kind, "__name__", "value")
        return checked
    if kind not in (int, float):
        return kind
    from ..cli.args import bounded

    default_minimum = (0 if f.name == "seed" else 1) if kind is int else 0.0
    return bounded(kind, f.metadata.get("minimum", default_minimum), f.metadata.get("maximum"))


def add_option_flags(parser, options_type: type) -> None:
    """One ``--flag`` per field of the ``options_type`` dataclass; numbers are range-checked
    (see :func:`_flag_parser`) so a bad value is refused before any model loads."""
    for f in dataclasses.fields(options_type):
        flag = "--" + f.name.replace("_", "-")
        kind, several = _flag_type(f)
        kind = _flag_parser(f, kind)
        shown = f.default if not isinstance(f.default, tuple) else " ".join(map(str, f.default))
        help_text = f.metadata.get("help", "") + (f" (default: {shown})" if shown not in ("", ()) else "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind, nargs="+" if several else None, default=None, help=help_text,
                                metavar=f.name.upper(), choices=f.metadata.get("choices"))


def options_from_flags(options_type: type, args: Any, base: Any = None) -> Any:
    """``base`` (default: the type's defaults) with every flag the user gave applied."""
    options = base if base is not None else options_type()
    given = {}
    for f in dataclasses.fields(options_type):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(options, **given)


def options_dict(options: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()}


# --- the evaluation registry entry ---------------------------------------------------------------------


@dataclass
class Evaluation:
    """One evaluation: how to run it on a model, plot and report the results of several models."""

    name: str
    title: str  # what it measures and the paper's figure, e.g. "Multi-needle retrieval (Table 2, Fig. 5)"
    options_type: type
    run: Callable[[ModelUnderTest, Any, EvalText], dict]
    plot: Callable[[dict[str, dict], Any, Path], None]
    report: Callable[[dict[str, dict], Any], str]


# --- output files ---------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically (NaN/inf become null)."""
    text = json.dumps(_finite(data), indent=2) + "\n"
    return write_text_atomically(path, text)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.0)):
    """(figure, axes) without pyplot: an Agg-rendered matplotlib Figure, axes always a flat list."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path: Path) -> Path:
    """Render ``fig`` to a PNG at ``path`` (Agg backend), atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


KIND_COLORS = {"standard": "#4c72b0", "diff": "#dd8452", "diff_v2": "#55a868"}
EXTRA_COLORS = ("#8172b3", "#c44e52", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


def model_colors(results: dict[str, dict]) -> dict[str, str]:
    """A colour per model label: blue for the first Transformer, orange for the first DIFF, green for
    the first DIFF V2 (as in every plot of the suite), other colours for further models."""
    colors, used, extra = {}, set(), 0
    for label, result in results.items():
        kind = result["model"]["attention"]
        if kind in KIND_COLORS and kind not in used:
            colors[label] = KIND_COLORS[kind]
            used.add(kind)
        else:
            colors[label] = EXTRA_COLORS[extra % len(EXTRA_COLORS)]
            extra += 1
    return colors


# --- Markdown --------------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def pairs_to_compare(results: dict[str, dict]) -> list[tuple[str, str]]:
    """(baseline label, DIFF-kind label) pairs among the results, in order. Labels of one seed
    of a comparison ("DIFF s1", as ``compare`` names them) are paired with the same seed only."""
    baselines = [k for k, r in results.items() if r["model"]["attention"] == BASELINE]
    diffs = [k for k, r in results.items() if r["model"]["attention"] in DIFF_KINDS]
    return [(b, d) for b in baselines for d in diffs if _seed_of(b) == _seed_of(d)]


def _seed_of(label: str) -> str | None:
    """"DIFF s2" -> "2"; None for a label without a seed suffix."""
    head, _, tail = label.rpartition(" s")
    return tail if head and tail.isdigit() else None


def comparison_sentence(
    what: str,
    baseline: tuple[str, float],
    candidate: tuple[str, float],
    *,
    higher_is_better: bool,
    paper_says_candidate_better: bool = True,
    noise: float = 0.0,
    digits: int = 3,
) -> str:
    """A plain sentence: does our small-scale result agree with the paper's direction?

    ``noise`` is the difference below which the two are reported as indistinguishable
    (e.g. two standard errors of an accuracy).
    """
    (b_label, b), (c_label, c) = baseline, candidate
    if b is None or c is None or not (math.isfinite(b) and math.isfinite(c)):
        return f"{what}: not measurable for {b_label} vs {c_label}."
    diff = c - b
    ours = f"{what}: {c_label} {c:.{digits}f} vs {b_label} {b:.{digits}f}"
    if abs(diff) <= noise:
        return f"{ours} — within noise (±{noise:.{digits}f}), so this run neither confirms nor contradicts the paper."
    candidate_better = (diff > 0) == higher_is_better
    if candidate_better == paper_says_candidate_better:
        return f"{ours} — agrees with the paper."
    return f"{ours} — **contradicts the paper** at this scale."


def mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")
