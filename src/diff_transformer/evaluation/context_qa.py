"""Question answering over a supplied context, without a judge: exact match and the lookback ratio.

The paper's Table 4 asks GPT-4o whether summaries and answers hallucinate. Here every item of a
JSON Lines file gives a context, a question and its accepted answers; the model answers greedily
after "CONTEXT\\nQuestion: QUESTION\\nAnswer:" (the answer ends at the first newline), and is scored
by normalised exact match against any accepted answer (the SQuAD normalisation of Rajpurkar et al.
2016: lower case, punctuation and the articles a/an/the removed, whitespace collapsed; NQ-open is
scored so too) and by whether its answer appears in the context (normalised, on word boundaries):
an answer taken from the context, right or wrong. The lookback ratio of each answer (Chuang et al.
2024, diff_transformer.evaluation.lookback: the context is everything before "\\nAnswer:"), per layer
and head, and how well it separates right answers from wrong ones: per layer, the AUROC of the head-mean ratio with
labels from exact match, with a stratified bootstrap 95% interval.

The format, one object a line (NQ-open with its documents joined into the context, FaithEval's
counterfactual and unanswerable sets with "unknown" as the answer, fit it)::

    {"context": "The lighthouse was built by Tomas Heill.", "question": "Who built it?", "answers": ["Tomas Heill"]}

"answers" is a list of strings (or one string). An item whose prompt and answer do not fit the
model's context is refused with its line number, as are missing or empty fields.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..progress import progress as progress_bar
from .lookback import LOOKBACK_DEFINITION, LookbackTap, head_means
from .models import ModelUnderTest
from .options import Evaluation, option
from .output import comparison_sentence, fmt, markdown_table, model_colors, new_figure, pairs_to_compare, save_figure
from .scoring import greedy_decode
from .stats import auroc, auroc_interval, binomial_se
from .texts import EvalText
from ..user_text import checked_text, json_objects

NAME = "context-qa"
SAMPLE = Path(__file__).resolve().parent.parent / "assets" / "context_qa" / "sample.jsonl"
QUESTION = "\nQuestion: "
ANSWER_MARKER = "\nAnswer:"
FIELDS = ("context", "question", "answers")


@dataclass(frozen=True)
class ContextQAItem:
    line: int  # its line in the file, from 1
    context: str
    question: str
    answers: tuple[str, ...]


def load_items(path: str | Path) -> list[ContextQAItem]:
    """The items of a JSON Lines file; a ValueError naming the file, the line and the field otherwise."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():  # anything else that is not a file: json_objects names it
        raise ValueError(f"{path}: no such JSON Lines file")
    items = []
    for number, record in json_objects(path):
        missing = [f for f in FIELDS if f not in record]
        if missing:
            raise ValueError(f"{path}:{number}: missing field {', '.join(repr(f) for f in missing)} "
                             f"(each line needs {', '.join(FIELDS)})")
        for name in ("context", "question"):
            if not isinstance(record[name], str) or not record[name].strip():
                raise ValueError(f"{path}:{number}: {name!r} must be a non-empty string, got {record[name]!r}")
            checked_text(record[name], f"{path}:{number}: field {name!r}")  # a NUL escaped in JSON is no text either
        answers = record["answers"]
        answers = [answers] if isinstance(answers, str) else answers
        if (not isinstance(answers, list) or not answers
                or any(not isinstance(a, str) or not normalize_answer(a) for a in answers)):
            raise ValueError(f"{path}:{number}: 'answers' must be a non-empty list of answers, each with a word "
                             f"(not only punctuation or articles), got {record['answers']!r}")
        items.append(ContextQAItem(number, record["context"], record["question"], tuple(answers)))
    if not items:
        raise ValueError(f"{path}: no items (one JSON object a line, with {', '.join(FIELDS)})")
    return items


def check_data_file(path: str) -> None:
    """The --data flag's check: the file reads as items (a ValueError naming the line otherwise)."""
    load_items(path)


@dataclass
class ContextQAOptions:
    data: str = option("", "JSON Lines of {context, question, answers}, one item a line (default: the 20-item "
                       "sample shipped with the package)", check=check_data_file, metavar="FILE.jsonl")
    max_new_tokens: int = option(16, "tokens generated per answer (greedy; the answer ends at the first newline)")
    batch_size: int = option(8, "prompts decoded together")
    resamples: int = option(2000, "bootstrap resamples of each AUROC's interval (level 0.95)", minimum=100)
    seed: int = option(0, "seed of the bootstrap")

    @classmethod
    def quick(cls) -> "ContextQAOptions":
        return cls(max_new_tokens=8, resamples=200)


# --- scoring an answer --------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (Rajpurkar et al. 2016, its v1.1 evaluation script): lower case, ASCII
    punctuation dropped, the articles a / an / the dropped, runs of whitespace made one space."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    """Whether the normalised prediction equals one of the normalised answers."""
    return normalize_answer(prediction) in {normalize_answer(a) for a in answers}


def in_context(text: str, context: str) -> bool:
    """Whether normalised ``text`` (not empty) appears in the normalised context as whole words."""
    needle = normalize_answer(text)
    return bool(needle) and f" {needle} " in f" {normalize_answer(context)} "


# --- the prompt, the answer and its rows ----------------------------------------------------------------


def encode_item(tokenizer, item: ContextQAItem) -> tuple[list[int], int]:
    """The prompt's tokens, [end of text] + "CONTEXT\\nQuestion: QUESTION" + "\\nAnswer:", and where the
    answer marker starts (the lookback ratio's context ends there)."""
    head = [tokenizer.eos_id] + tokenizer.encode(item.context + QUESTION + item.question)
    return head + tokenizer.encode(ANSWER_MARKER), len(head)


def answer_of(tokenizer, generated: list[int]) -> tuple[str, int]:
    """The answer's text (the decoded tokens up to the first newline, stripped) and its token count:
    the generated tokens before the first one whose text holds a newline."""
    for count in range(len(generated)):
        if "\n" in tokenizer.decode(generated[: count + 1]):
            return tokenizer.decode(generated[:count]).split("\n")[0].strip(), count
    return tokenizer.decode(generated).strip(), len(generated)


@torch.no_grad()
def answer_lookback(model, tokens: list[int], marker: int, prompt_length: int, rows: int) -> Tensor:
    """The lookback ratio (L, H) of an answer, the mean over its ``rows`` rows: the prompt's last
    position (which produced the first answer token) and the positions of the first ``rows − 1``
    answer tokens of ``tokens`` (prompt + answer). The prompt before its last token runs into a KV
    cache on the fast path; only the answer's rows run through the tap (reference attention)."""
    device = model.embed.weight.device
    start = prompt_length - 1
    cache = model.new_cache(1, start + rows)
    model(torch.tensor([tokens[:start]], device=device), cache=cache, logits_to_keep=1)
    tap = LookbackTap([[(start + r, marker) for r in range(rows)]])
    with model.tap_attention(tap):
        model(torch.tensor([tokens[start: start + rows]], device=device), cache=cache, logits_to_keep=1)
    return tap.per_example()[0].nanmean(dim=-1)  # (L, H, rows) -> (L, H)


def _auroc_entry(right: list[float], wrong: list[float], options: ContextQAOptions) -> dict[str, Any]:
    interval = auroc_interval(right, wrong, resamples=options.resamples, seed=options.seed)
    return {"auroc": auroc(right, wrong), "low": interval[0] if interval else None,
            "high": interval[1] if interval else None}


def separation(lookback: list[Tensor], right: list[bool], options: ContextQAOptions) -> dict[str, Any]:
    """How the answers' lookback ratios ((L, H) each) separate right answers from wrong ones: per layer
    the AUROC of the head-mean ratio with its bootstrap interval, the same for the mean over layers,
    and per head the AUROC alone; the mean ratio per layer."""
    ratios = torch.stack(lookback).double()  # (N, L, H)
    by_layer = head_means(lookback)  # (N, L)
    labels = torch.tensor(right)

    def split(values: Tensor) -> tuple[list[float], list[float]]:
        keep = ~values.isnan()
        return values[keep & labels].tolist(), values[keep & ~labels].tolist()

    return {
        "definition": LOOKBACK_DEFINITION,
        "per_layer": [_finite(v) for v in by_layer.nanmean(dim=0).tolist()],
        "auroc": [{"layer": layer, **_auroc_entry(*split(by_layer[:, layer]), options)}
                  for layer in range(by_layer.shape[1])],
        "mean_over_layers": _auroc_entry(*split(by_layer.nanmean(dim=1)), options),
        "per_head_auroc": [[auroc(*split(ratios[:, layer, head])) for head in range(ratios.shape[2])]
                           for layer in range(ratios.shape[1])],
        "right": int(labels.sum()),
        "wrong": int((~labels).sum()),
    }


def _finite(value: float) -> float | None:
    return value if value == value else None


def run(mut: ModelUnderTest, options: ContextQAOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    data = Path(options.data) if options.data else SAMPLE
    items = load_items(data)
    tok = mut.tokenizer
    encoded = [encode_item(tok, item) for item in items]
    too_long = [item.line for item, (prompt, _) in zip(items, encoded)
                if len(prompt) + options.max_new_tokens > mut.max_seq_len]
    if too_long:
        first = next(len(p) for item, (p, _) in zip(items, encoded) if item.line == too_long[0])
        more = f" (and {len(too_long) - 1} more line{'s' if len(too_long) > 2 else ''})" if len(too_long) > 1 else ""
        raise ValueError(f"{data}:{too_long[0]}{more}: the prompt is {first} tokens with this model's tokenizer; with "
                         f"max_new_tokens={options.max_new_tokens} it needs {first + options.max_new_tokens}, beyond "
                         f"the model's context of {mut.max_seq_len} tokens (shorten the context, give fewer "
                         "--max-new-tokens, or read the model at a longer --max-seq-len)")
    newline = tok.encode("\n")
    stop = [tok.eos_id] + (newline if len(newline) == 1 else [])
    order = sorted(range(len(items)), key=lambda i: len(encoded[i][0]))  # similar lengths decode together
    generated: dict[int, list[int]] = {}
    batches = range(0, len(order), options.batch_size)
    for start in progress_bar(batches, desc=f"context-qa {mut.label}", disable=not progress, leave=False):
        chunk = order[start: start + options.batch_size]
        for i, new in zip(chunk, greedy_decode(mut.model, [encoded[i][0] for i in chunk], options.max_new_tokens,
                                               stop)):
            generated[i] = new
    answers, lookback, right = [], [], []
    for i, item in enumerate(items):
        prompt, marker = encoded[i]
        prediction, count = answer_of(tok, generated[i])
        ratios = answer_lookback(mut.model, prompt + generated[i], marker, len(prompt), max(1, count))
        correct = exact_match(prediction, item.answers)
        answers.append({"line": item.line, "prediction": prediction, "exact_match": correct,
                        "in_context": in_context(prediction, item.context),
                        "answer_in_context": any(in_context(a, item.context) for a in item.answers),
                        "lookback": [[round(v, 4) if v == v else None for v in layer] for layer in ratios.tolist()]})
        lookback.append(ratios)
        right.append(correct)
    grounded = [a for a in answers if a["answer_in_context"]]
    return {
        "model": mut.describe(),
        "data": str(data),
        "items": len(items),
        "prompt": "<end of text>CONTEXT" + QUESTION + "QUESTION" + ANSWER_MARKER,
        "exact_match": sum(right) / len(right),
        "prediction_in_context": sum(a["in_context"] for a in answers) / len(answers),
        "answer_in_context": len(grounded) / len(answers),
        "exact_match_answer_in_context": (sum(a["exact_match"] for a in grounded) / len(grounded)
                                          if grounded else None),
        "lookback": separation(lookback, right, options),
        "answers": answers,
    }


def plot(results: dict[str, dict], options: ContextQAOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=2, size=(5.2, 3.8))
    for label, r in results.items():
        entries = r["lookback"]["auroc"]
        layers = [e["layer"] for e in entries]
        values = [float("nan") if e["auroc"] is None else e["auroc"] for e in entries]
        low = [v - e["low"] if e["low"] is not None else 0.0 for v, e in zip(values, entries)]
        high = [e["high"] - v if e["high"] is not None else 0.0 for v, e in zip(values, entries)]
        axes[0].errorbar(layers, values, yerr=[low, high], fmt="o-", capsize=3, color=colors[label], label=label)
        per_layer = [float("nan") if v is None else v for v in r["lookback"]["per_layer"]]
        axes[1].plot(layers, per_layer, "o-", color=colors[label], label=label)
    axes[0].axhline(0.5, color="grey", ls="--", lw=0.8)
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_title("lookback ratio: right vs wrong answers")
    axes[0].set_ylabel("AUROC (95% bootstrap interval)")
    axes[1].set_title("mean lookback ratio of the answers")
    axes[1].set_ylabel("lookback ratio")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def _interval(entry: dict[str, Any]) -> str:
    if entry["auroc"] is None:
        return "–"
    return fmt(entry["auroc"], 3) + (f" [{entry['low']:.3f}, {entry['high']:.3f}]" if entry["low"] is not None else "")


def report(results: dict[str, dict], options: ContextQAOptions) -> str:
    headers = ["Model", "Items", "Exact match", "Answer found in context", "Gold answer in context",
               "Exact match where it is", "Lookback AUROC, mean over layers [95%]", "Best layer's AUROC"]
    rows = []
    for label, r in results.items():
        look = r["lookback"]
        best = max((e for e in look["auroc"] if e["auroc"] is not None), key=lambda e: abs(e["auroc"] - 0.5),
                   default=None)
        rows.append([label, r["items"], fmt(r["exact_match"], 3), fmt(r["prediction_in_context"], 3),
                     fmt(r["answer_in_context"], 3), fmt(r["exact_match_answer_in_context"], 3),
                     _interval(look["mean_over_layers"]),
                     "–" if best is None else f"layer {best['layer']}: {_interval(best)}"])
    first = next(iter(results.values()))
    lines = [markdown_table(headers, rows), "",
             f"{first['data']}: greedy answers after \"CONTEXT\\nQuestion: QUESTION\\nAnswer:\", scored by SQuAD-"
             "normalised exact match against any accepted answer (no judge); \"found in context\": the answer appears "
             "in the context. Lookback AUROC: how well the head-mean lookback ratio (Chuang et al. 2024; |A| on the "
             "effective map, so DIFF's signed maps count) separates right answers from wrong ones, 0.5 none, with a "
             f"stratified bootstrap 95% interval ({options.resamples} resamples). The paper's Table 4 judges "
             "summaries and answers of 3B models with GPT-4o (DIFF ahead by 0.07–0.19 of accuracy); exact match "
             "on short answers is the judge-free part of that comparison."]
    for base, cand in pairs_to_compare(results):
        b, c = results[base]["exact_match"], results[cand]["exact_match"]
        n = results[base]["items"]
        lines += ["", comparison_sentence("Exact match over the context (direction expected from the paper's "
                                          "Table 4)", (base, b), (cand, c), higher_is_better=True,
                                          noise=2 * 2**0.5 * binomial_se((b + c) / 2, n), digits=3)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Question answering over a context: exact match and the lookback ratio (paper Table 4, no judge)",
    options_type=ContextQAOptions,
    run=run,
    plot=plot,
    report=report,
)
