"""Many-shot in-context classification and its robustness to demonstration order (paper Fig. 6, 7, 9).

Prompts are [end-of-text] then demonstrations "Input: TEXT\\nLabel: LABEL\\n", then the test
"Input: TEXT\\nLabel:". Constrained decoding: every label's tokens are scored as a continuation
(sum of log-probabilities) and the best-scoring label is the prediction, so the model can only
answer with a valid label. The demonstrations run once into a KV cache that every test item
continues, and every label branches off its test item's cache (``scoring.score_choices``).

- Accuracy vs number of demonstrations, on class-balanced test items: for each count,
  demonstrations drawn at random from the rest (random order); counts whose prompt exceeds the
  model's context are skipped.
- Robustness: with one class-balanced set of demonstrations (the largest count that fits,
  rounded down to a multiple of the classes), accuracy over K orderings, in two layouts:
  "random" (shuffled) and "alternating" (classes cycle c1 c2 … cK c1 c2 …; the order of the
  cycle and of the items within a class is shuffled). Robustness = best − worst accuracy.

Tasks: generated keyword classification ("keywords-C": C classes, each set by which keyword an
input holds, a fresh random keyword -> label mapping per task, so only the context can tell the
labels; see ``data.synthetic.keyword_task``), and any JSONL file with text and label fields
(``--data FILE --text-field text --label-field label``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..progress import progress as progress_bar

from ..data.synthetic import ClassificationTask, encode_demonstration, encode_label, encode_query, keyword_task
from .. import paper
from .models import ModelUnderTest
from .options import Evaluation, option
from .output import (
    comparison_sentence,
    fmt,
    markdown_table,
    model_colors,
    new_figure,
    pairs_to_compare,
    save_figure,
)
from .scoring import score_choices
from .stats import binomial_se, mean, seeded_rng
from .texts import EvalText
from ..user_text import checked_text, json_objects

NAME = "icl"
LAYOUTS = ("random", "alternating")


@dataclass
class ICLOptions:
    tasks: tuple[str, ...] = option(("keywords-4", "keywords-8"),
                                    "generated tasks, keywords-C with C classes (none: give 'none')",
                                     check=lambda s: check_task_name(s))
    demos: tuple[int, ...] = option((0, 1, 2, 4, 8, 16, 32, 64),
                                    "numbers of demonstrations (those that fit the context)", minimum=0)
    test_items: int = option(32, "test items per task")
    orders: int = option(5, "orderings of the demonstrations for robustness (K)")
    robustness_demos: int = option(0, "demonstrations for robustness (0 = the largest count that fits)", minimum=0)
    data: str = option("", "a JSONL file of labelled texts to evaluate as well")
    text_field: str = option("text", "field of --data holding the text")
    label_field: str = option("label", "field of --data holding the label")
    batch_size: int = option(64, "continuations scored per forward pass")
    seed: int = option(0, "seed of tasks, demonstrations and orders")

    @classmethod
    def quick(cls) -> "ICLOptions":
        return cls(tasks=("keywords-4",), demos=(0, 4), test_items=8, orders=2)


def load_jsonl_task(path: str | Path, text_field: str, label_field: str) -> ClassificationTask:
    """A classification task from a JSONL file: one object per line with a text and a label."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():  # anything else that is not a file: read_text_file names it
        raise FileNotFoundError(f"{path}: no such JSONL file")
    texts, raw_labels = [], []
    for number, record in json_objects(path):
        if text_field not in record or label_field not in record:
            raise ValueError(f"{path}:{number}: needs the fields {text_field!r} and {label_field!r}")
        text = str(record[text_field]).replace("\n", " ").strip()
        checked_text(text, f"{path}:{number}: field {text_field!r}")  # a NUL escaped in JSON is no text either
        if not text:
            raise ValueError(f"{path}:{number}: empty {text_field!r}")
        texts.append(text)
        raw_labels.append(str(record[label_field]).strip())
    labels = sorted(set(raw_labels))
    if len(labels) < 2:
        raise ValueError(f"{path}: needs at least two distinct labels in {label_field!r}, found {labels}")
    index = {label: i for i, label in enumerate(labels)}
    return ClassificationTask(name=path.stem, labels=labels,
                              items=[(t, index[raw]) for t, raw in zip(texts, raw_labels)])


def check_task_name(spec: str) -> None:
    """A ValueError unless ``spec`` names a generated task ('keywords-C', 2 <= C <= 30) or is 'none'."""
    match = re.fullmatch(r"keywords-(\d+)", spec)
    if spec != "none" and not match:
        raise ValueError(f"unknown ICL task {spec!r}; generated tasks are named keywords-C (C classes)")
    if match and not 2 <= int(match[1]) <= 30:
        raise ValueError(f"keywords-C needs 2 <= C <= 30 classes, got {match[1]}")


def build_tasks(options: ICLOptions) -> list[ClassificationTask]:
    tasks = []
    pool_size = options.test_items + 4 * max(max(options.demos, default=0), options.robustness_demos, 16)
    for spec in options.tasks:
        if spec == "none":
            continue
        match = re.fullmatch(r"keywords-(\d+)", spec)
        if not match:
            raise ValueError(f"unknown ICL task {spec!r}; generated tasks are named keywords-C (C classes)")
        tasks.append(keyword_task(seeded_rng("icl-task", options.seed, spec), n_classes=int(match[1]),
                                  n_items=pool_size, name=spec))
    if options.data:
        task = load_jsonl_task(options.data, options.text_field, options.label_field)
        rng = seeded_rng("icl-data", options.seed)
        task.items = rng.sample(task.items, len(task.items))
        if len(task.items) <= options.test_items:
            raise ValueError(f"{options.data}: {len(task.items)} records; "
                             f"need more than --test-items={options.test_items}")
        tasks.append(task)
    if not tasks:
        raise ValueError("no ICL task: give --tasks keywords-C and/or --data FILE")
    return tasks


def _accuracy(mut: ModelUnderTest, task: ClassificationTask, demos, tests, batch_size: int) -> tuple[float | None, int]:
    """(accuracy or None if the prompt does not fit, prompt tokens)."""
    tok = mut.tokenizer
    prefix = [tok.eos_id]
    for text, label in demos:
        prefix += encode_demonstration(tok, text, task.labels[label])
    labels = [encode_label(tok, label) for label in task.labels]
    queries = [encode_query(tok, text) for text, _ in tests]
    if len(prefix) + max(map(len, queries)) + max(map(len, labels)) > mut.max_seq_len:
        return None, len(prefix)
    scores = score_choices(mut.model, prefix, queries, labels, batch_size=batch_size)
    correct = sum(row.index(max(row)) == label for row, (_, label) in zip(scores, tests))
    return correct / len(tests), len(prefix)


def arrange(demos: list[tuple[str, int]], layout: str, rng) -> list[tuple[str, int]]:
    """The demonstrations in a random order, or with classes alternating."""
    if layout == "random":
        return rng.sample(demos, len(demos))
    if layout != "alternating":
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    by_class: dict[int, list] = {}
    for item in demos:
        by_class.setdefault(item[1], []).append(item)
    queues = [rng.sample(items, len(items)) for _, items in sorted(by_class.items())]
    queues = rng.sample(queues, len(queues))
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop())
    return out


def balanced_demos(task: ClassificationTask, pool, count: int, rng) -> list[tuple[str, int]]:
    per_class = max(1, count // len(task.labels))
    chosen = []
    for label in range(len(task.labels)):
        of_class = [item for item in pool if item[1] == label]
        chosen += rng.sample(of_class, min(per_class, len(of_class)))
    return chosen


def split_test_items(task: ClassificationTask, count: int) -> tuple[list, list]:
    """(test items, demonstration pool): the test items taken class by class in turn, so that the
    classes are as balanced as the data allows (a model that always says one label scores 1/C)."""
    by_class: dict[int, list] = {}
    for item in task.items:
        by_class.setdefault(item[1], []).append(item)
    queues = [list(reversed(items)) for _, items in sorted(by_class.items())]
    tests = []
    while len(tests) < count and any(queues):
        for queue in queues:
            if queue and len(tests) < count:
                tests.append(queue.pop())
    chosen = set(map(id, tests))
    return tests, [item for item in task.items if id(item) not in chosen]


def run(mut: ModelUnderTest, options: ICLOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    out = {}
    for task in build_tasks(options):
        tests, pool = split_test_items(task, options.test_items)
        curve = []
        for n in progress_bar(options.demos, desc=f"icl {task.name} {mut.label}", disable=not progress, leave=False):
            if n > len(pool):
                curve.append({"demos": n, "accuracy": None, "prompt_tokens": None,
                              "skipped": "not enough demonstrations"})
                continue
            demos = seeded_rng("icl-demos", options.seed, task.name, n).sample(pool, n)
            accuracy, tokens = _accuracy(mut, task, demos, tests, options.batch_size)
            curve.append({"demos": n, "accuracy": accuracy, "prompt_tokens": tokens})
        fitted = [c["demos"] for c in curve if c["accuracy"] is not None]
        if not fitted:
            raise ValueError(f"{task.name}: no number of demonstrations of {tuple(options.demos)} fits the model's "
                             f"context of {mut.max_seq_len} tokens with a test item (prompts of "
                             f"{min(c['prompt_tokens'] or 0 for c in curve):,} tokens and more)")
        count = options.robustness_demos or max(fitted, default=0)
        count -= count % len(task.labels)
        robustness: dict[str, Any] = {"demos": count}
        if count >= len(task.labels):
            demos = balanced_demos(task, pool, count, seeded_rng("icl-robust", options.seed, task.name))
            for layout in LAYOUTS:
                accuracies = []
                for k in range(options.orders):
                    ordered = arrange(demos, layout, seeded_rng("icl-order", options.seed, task.name, layout, k))
                    accuracies.append(_accuracy(mut, task, ordered, tests, options.batch_size)[0])
                valid = [a for a in accuracies if a is not None]
                if not valid:
                    raise ValueError(f"{task.name}: robustness_demos={options.robustness_demos} does not fit the "
                                     f"model's context of {mut.max_seq_len} tokens with a test item")
                robustness[layout] = {
                    "accuracies": accuracies,
                    "mean": mean(valid),
                    "spread": (max(valid) - min(valid)) if valid else None,
                }
        out[task.name] = {"classes": len(task.labels), "chance": 1 / len(task.labels), "test_items": len(tests),
                          "curve": curve, "robustness": robustness}
    return {"model": mut.describe(), "tasks": out}


def plot(results: dict[str, dict], options: ICLOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=2, size=(5.4, 3.8))
    styles = ("o-", "s--", "^:", "d-.")
    ax = axes[0]
    counts = set()
    for label, r in results.items():
        for t, (name, task) in enumerate(r["tasks"].items()):
            points = [(c["demos"], c["accuracy"]) for c in task["curve"] if c["accuracy"] is not None]
            if points:
                xs, ys = zip(*points)
                counts.update(xs)
                ax.plot(xs, ys, styles[t % len(styles)], color=colors[label], label=f"{label} {name}")
    for t, (_name, task) in enumerate(next(iter(results.values()))["tasks"].items()):
        ax.axhline(task["chance"], color="grey", ls=styles[t % len(styles)][1:], lw=0.8, alpha=0.6)
    ax.set_xscale("symlog", linthresh=1)  # 0 demonstrations stays on the axis
    ax.set_xticks(sorted(counts), [str(c) for c in sorted(counts)])
    ax.set_xlabel("demonstrations (grey: chance)")
    ax.set_ylabel("accuracy")
    ax.set_title("Many-shot classification (cf. Fig. 6)")
    ax.legend(fontsize=7)
    ax = axes[1]
    ticks = []
    x = 0
    for label, r in results.items():
        for name, task in r["tasks"].items():
            for layout in LAYOUTS:
                entry = task["robustness"].get(layout)
                if not entry:
                    continue
                ys = [a for a in entry["accuracies"] if a is not None]
                ax.scatter([x] * len(ys), ys, color=colors[label], s=14)
                if ys:
                    ax.vlines(x, min(ys), max(ys), color=colors[label])
                ticks.append((x, f"{label}\n{name}\n{layout}"))
                x += 1
    ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=6)
    ax.set_ylabel("accuracy per ordering")
    ax.set_title(f"Robustness to order, {options.orders} orderings (cf. Fig. 7)")
    save_figure(fig, path)


def report(results: dict[str, dict], options: ICLOptions) -> str:
    first = next(iter(results.values()))
    lines = []
    for name, task in first["tasks"].items():
        counts = [c["demos"] for c in task["curve"]]
        headers = ["Model", *[f"{n} demos" for n in counts], "spread (random)", "spread (alternating)"]
        rows = []
        for label, r in results.items():
            t = r["tasks"][name]
            rob = t["robustness"]
            rows.append([label, *[fmt(c["accuracy"], 2) for c in t["curve"]],
                         fmt(rob.get("random", {}).get("spread"), 2), fmt(rob.get("alternating", {}).get("spread"), 2)])
        lines += [f"Task {name} ({task['classes']} classes, chance {task['chance']:.2f}, "
                  f"{task['test_items']} test items; "
                  f"robustness with {task['robustness']['demos']} demonstrations, {options.orders} orderings):", "",
                  markdown_table(headers, rows), ""]
    lines.append(f"Paper ({paper.ICL_FIGS['source']}): {paper.ICL_FIGS['accuracy_claim']}; "
                 f"{paper.ICL_FIGS['robustness_claim']}.")
    for base, cand in pairs_to_compare(results):
        for name in first["tasks"]:
            b, c = results[base]["tasks"][name], results[cand]["tasks"][name]
            b_acc = mean(x["accuracy"] for x in b["curve"] if x["demos"] > 0)
            c_acc = mean(x["accuracy"] for x in c["curve"] if x["demos"] > 0)
            n = b["test_items"] * max(1, sum(1 for x in b["curve"] if x["demos"] > 0 and x["accuracy"] is not None))
            noise = 2 * 2**0.5 * binomial_se((b_acc + c_acc) / 2, n) if b_acc == b_acc and c_acc == c_acc else 0.0
            lines += ["", comparison_sentence(f"{name}: mean accuracy with demonstrations", (base, b_acc),
                                              (cand, c_acc), higher_is_better=True, noise=noise, digits=2)]
            for layout in LAYOUTS:
                bs = b["robustness"].get(layout, {}).get("spread")
                cs = c["robustness"].get(layout, {}).get("spread")
                if bs is not None and cs is not None:
                    lines += ["", comparison_sentence(f"{name}: best−worst spread over orders ({layout})",
                                                      (base, bs), (cand, cs),
                                                      higher_is_better=False, noise=1.0 / b["test_items"], digits=2)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Many-shot in-context learning and robustness to order (paper Fig. 6, 7, 9)",
    options_type=ICLOptions,
    run=run,
    plot=plot,
    report=report,
)
