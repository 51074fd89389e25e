"""Run the evaluations on several models and gather JSON, plots and Markdown report sections.

    from diff_transformer.evaluation import report_sections, run_suite
    result = run_suite({"standard": Path("out/compare/standard"), "diff": Path("out/compare/diff")},
                       Path("out/compare/eval"))
    print(result.markdown())
    sections = report_sections(checkpoints, Path("out/compare"))  # what `compare` appends to report.md

Every evaluation runs on every model and writes OUT/NAME.json and OUT/NAME.png. The default
budget is sized for a CPU (the whole suite on two "tiny" models in a few minutes); ``quick``
shrinks it to a smoke test. An evaluation that cannot run on a model (a context too short for
its documents, say) is reported as such and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from ..files import check_output_dir, claim_output_dir
from ..progress import progress as progress_bar

from . import ar_hit, attention_noise, attention_sink, icl, mqar, needle, outliers, position_nll, quantization, scaling
from .models import ModelUnderTest, load_model
from .options import Evaluation, options_dict
from .output import write_json
from .texts import EvalText

EVALUATIONS: dict[str, Evaluation] = {
    module.SPEC.name: module.SPEC
    for module in (needle, attention_noise, outliers, quantization, ar_hit, position_nll, icl, mqar, attention_sink)
}
"""Evaluations run on each model, by name, in the order of the paper's sections (then the others)."""

NAMES = (*EVALUATIONS, scaling.NAME)


class EvaluationError(ValueError):
    """An evaluation cannot run on a model (the message names both, and why)."""


@dataclass
class SuiteResult:
    """Per evaluation: a Markdown section (ours beside the paper's figure), the JSON-able data,
    the files written; ``markdown()`` joins the sections with their plots."""

    sections: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    images: dict[str, Path] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def markdown(self, relative_to: Path | None = None, heading: str = "###") -> str:
        """All sections; plot links are relative to ``relative_to`` (the report's folder) if given."""
        parts = []
        for name, section in self.sections.items():
            title = self.data.get(name, {}).get("title", name)
            parts.append(f"{heading} {title}\n\n{section}")
            image = self.images.get(name)
            if image is not None:
                link = image.resolve().relative_to(relative_to.resolve()) if relative_to else image
                parts.append(f"![{name}]({link.as_posix()})")
        return "\n\n".join(parts) + "\n"


def run_evaluation(
    spec: Evaluation,
    models: Sequence[ModelUnderTest],
    out_dir: Path,
    *,
    options: Any = None,
    text: EvalText | None = None,
    progress: bool = True,
    strict: bool = False,
) -> tuple[dict[str, Any], str, list[Path]]:
    """Run one evaluation on every model; write OUT/NAME.json and OUT/NAME.png.

    Returns the JSON data, the Markdown section and the files written. A model the evaluation
    cannot run on (ValueError) is listed under "errors" and left out of the plot and report; with
    ``strict`` it is an :class:`EvaluationError` instead, and nothing is written.
    """
    reading = [m.checkpoint for m in models if m.checkpoint]
    check_output_dir(out_dir, "eval", reuse=True, reading=reading)
    options = options if options is not None else spec.options_type()
    text = text or EvalText()
    results, errors, seconds = {}, {}, {}
    for mut in models:
        start = time.perf_counter()
        try:
            with torch.no_grad():
                results[mut.label] = spec.run(mut, options, text, progress=progress)
        except ValueError as exc:
            if strict:
                raise EvaluationError(f"{spec.name} cannot run on {mut.label}: {exc}; nothing written") from None
            errors[mut.label] = str(exc)
        seconds[mut.label] = round(time.perf_counter() - start, 2)
    data = {"evaluation": spec.name, "title": spec.title, "options": options_dict(options), "models": results,
            "errors": errors, "seconds": seconds}
    out_dir = claim_output_dir(out_dir, "eval", reading=reading)
    files = [write_json(out_dir / f"{spec.name}.json", data)]
    lines = []
    if results:
        spec.plot(results, options, out_dir / f"{spec.name}.png")
        files.append(out_dir / f"{spec.name}.png")
        lines.append(spec.report(results, options))
    lines += [f"Not run on {label}: {message}" for label, message in errors.items()]
    return data, "\n\n".join(lines), files


def evaluation_options(name: str, overrides: dict[str, Any] | None = None, *, quick: bool = False) -> Any:
    """The options of evaluation ``name``: its defaults (or its quick budget), with ``overrides``
    (option name -> value; lists become tuples). An unknown option is a ValueError naming it."""
    spec = EVALUATIONS[name]
    base = spec.options_type.quick() if quick else spec.options_type()
    overrides = overrides or {}
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{name} has no option {unknown[0]!r} (its options: {', '.join(sorted(known))})")
    return dataclasses.replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})


def run_suite(
    checkpoints: dict[str, Path],
    out_dir: Path,
    *,
    quick: bool = False,
    options: dict[str, dict[str, Any]] | None = None,
    evaluations: Sequence[str] | None = None,
    device: str = "cpu",
    text: EvalText | None = None,
    scaling_runs: list[dict[str, Any]] | None = None,
    progress: bool = True,
) -> SuiteResult:
    """Run every evaluation (or those named) on each checkpoint (label -> directory); ``options``
    overrides options per evaluation (``{"outliers": {"tokens": 4096}}``) over the default or
    ``quick`` budget.

    ``scaling_runs`` ({attention, params, tokens, loss} dicts) adds the scaling fit; it is
    skipped otherwise, since one size per architecture cannot give a scaling law.
    """
    names = list(evaluations) if evaluations is not None else list(EVALUATIONS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown evaluation(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    out_dir = claim_output_dir(out_dir, "eval", reading=checkpoints.values())  # refused before any work
    text = text or EvalText()
    models = [load_model(path, device=device, label=label) for label, path in checkpoints.items()]
    result = SuiteResult()
    model_names = [n for n in names if n in EVALUATIONS]
    for name in progress_bar(model_names, desc="evaluation suite", disable=not progress):
        spec = EVALUATIONS[name]
        chosen = evaluation_options(name, (options or {}).get(name), quick=quick)
        data, section, files = run_evaluation(spec, models, out_dir, options=chosen, text=text, progress=progress)
        result.data[name], result.sections[name] = data, section
        result.files += files
        if data["models"]:
            result.images[name] = out_dir / f"{name}.png"
    if scaling.NAME in names and scaling_runs:
        data = {"evaluation": scaling.NAME, "title": scaling.TITLE, **scaling.evaluate(scaling_runs)}
        result.files.append(write_json(out_dir / f"{scaling.NAME}.json", data))
        scaling.plot(data, out_dir / f"{scaling.NAME}.png")
        result.files.append(out_dir / f"{scaling.NAME}.png")
        result.data[scaling.NAME], result.sections[scaling.NAME] = data, scaling.report(data)
        result.images[scaling.NAME] = out_dir / f"{scaling.NAME}.png"
    return result


def report_sections(checkpoints: dict[str, Path], out_dir: Path, *, quick: bool = False, **suite_options: Any) -> list[str]:
    """The evaluation step ``compare`` runs after training: the suite into OUT/eval, returned as
    Markdown sections for OUT/report.md (plot links relative to OUT)."""
    result = run_suite(checkpoints, Path(out_dir) / "eval", quick=quick, **suite_options)
    intro = ("## Evaluations of the paper\n\nEach section: our models (small, CPU-trained) beside the paper's figures "
             "(3B / 1.4B models). Only the direction of a difference can be compared; a sentence under each table "
             "says whether ours agrees with the paper. JSON and plots: eval/.")
    return [intro, result.markdown(relative_to=Path(out_dir))]
