"""Run the evaluations on several models and gather JSON, plots and Markdown report sections.

    from diff_transformer.evaluation import report_sections, run_suite
    result = run_suite({"standard": Path("out/compare/standard"), "diff": Path("out/compare/diff")},
                       Path("out/compare/eval"))
    print(result.markdown())
    sections = report_sections(checkpoints, Path("out/compare"))  # what `compare` appends to report.md

Every evaluation runs on every model and writes OUT/NAME.json and OUT/NAME.png, together (both
or neither, the JSON last). An earlier result in OUT is replaced only with ``overwrite``, and one
process at a time writes into OUT (its lock, ``.OUT.lock`` beside it, names the pid). The default
budget is sized for a CPU (the whole suite on two "tiny" models in a few minutes); ``quick``
shrinks it to a smoke test. An evaluation that cannot run on a model (a context too short for
its documents, say) is reported as such and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from ..files import OutputPathError, check_output_dir, claim_output_dir, lock_output, unclaim_output_dir
from ..progress import progress as progress_bar

from . import (
    ar_hit, attention_noise, attention_sink, context_qa, icl, mqar, needle, outliers, position_nll, quantization,
    scaling,
)
from .models import ModelUnderTest, load_model
from .options import Evaluation, options_dict
from .output import result_files, write_result
from .texts import EvalText

EVALUATIONS: dict[str, Evaluation] = {
    module.SPEC.name: module.SPEC
    for module in (needle, attention_noise, context_qa, outliers, quantization, ar_hit, position_nll, icl, mqar,
                   attention_sink)
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


def check_results_out(out_dir: Path, names: Sequence[str], *, overwrite: bool = False,
                      reading: Sequence[str | Path] = ()) -> None:
    """Refuse ``out_dir`` for the results of the evaluations ``names`` before any work: a directory
    the project did not write, a source being read (:func:`~diff_transformer.files.check_output_dir`),
    and, unless ``overwrite``, one that already holds a result of one of them (NAME.json or NAME.png)."""
    check_output_dir(out_dir, "eval", reuse=True, reading=reading)
    earlier = [] if overwrite else [path.name for name in names for path in result_files(Path(out_dir), name)
                                    if path.exists()]
    if earlier:
        raise OutputPathError(f"{out_dir}: already holds an earlier result ({', '.join(earlier)}); pass --overwrite "
                              "(overwrite=True) to replace it, or choose another --out")


def run_evaluation(
    spec: Evaluation,
    models: Sequence[ModelUnderTest],
    out_dir: Path,
    *,
    options: Any = None,
    text: EvalText | None = None,
    progress: bool = True,
    strict: bool = False,
    overwrite: bool = False,
) -> tuple[dict[str, Any], str, list[Path]]:
    """Run one evaluation on every model; write OUT/NAME.json and OUT/NAME.png (together, replacing
    an earlier result only with ``overwrite``; see :func:`check_results_out`).

    Returns the JSON data, the Markdown section and the files written. A model the evaluation
    cannot run on (ValueError) is listed under "errors" and left out of the plot and report; with
    ``strict`` it is an :class:`EvaluationError` instead, and nothing is written.
    """
    reading = [m.checkpoint for m in models if m.checkpoint]
    check_results_out(out_dir, [spec.name], overwrite=overwrite, reading=reading)
    with lock_output(out_dir):  # one writer per output (a no-op under run_suite's or the command's lock)
        check_results_out(out_dir, [spec.name], overwrite=overwrite, reading=reading)  # as it is now, locked
        options = options if options is not None else spec.options_type()
        text = text or EvalText()
        results, errors, seconds = {}, {}, {}
        for mut in models:
            result, error, seconds[mut.label] = measure(spec, mut, options, text, progress=progress)
            if error is not None:
                if strict:
                    raise EvaluationError(f"{spec.name} cannot run on {mut.label}: {error}; nothing written")
                errors[mut.label] = error
            else:
                results[mut.label] = result
        return write_evaluation(spec, options, results, errors, seconds, out_dir, reading)


def measure(spec: Evaluation, mut: ModelUnderTest, options: Any, text: EvalText, *,
            progress: bool = True) -> tuple[dict[str, Any] | None, str | None, float]:
    """One evaluation on one model: (its result, None), or (None, why it cannot run) when it raises a
    ValueError (a context too short for its documents, say); and the seconds it took."""
    start = time.perf_counter()
    try:
        with torch.no_grad():
            result, error = spec.run(mut, options, text, progress=progress), None
    except ValueError as exc:
        result, error = None, str(exc)
    return result, error, round(time.perf_counter() - start, 2)


def write_evaluation(spec: Evaluation, options: Any, results: dict[str, dict], errors: dict[str, str],
                     seconds: dict[str, float], out_dir: Path, reading: Sequence[str | Path]
                     ) -> tuple[dict[str, Any], str, list[Path]]:
    """One evaluation's results on several models (by label; ``errors``: the models it could not run
    on, and why) written as OUT/NAME.json and OUT/NAME.png (:func:`write_evaluation_result`); returns
    the JSON data, the Markdown section and the files written."""
    data = {"evaluation": spec.name, "title": spec.title, "options": options_dict(options), "models": results,
            "errors": errors, "seconds": seconds}
    plot = (lambda path: spec.plot(results, options, path)) if results else None
    files = write_evaluation_result(out_dir, spec.name, data, plot, reading)
    lines = [spec.report(results, options)] if results else []
    lines += [f"Not run on {label}: {message}" for label, message in errors.items()]
    return data, "\n\n".join(lines), files


def write_evaluation_result(out_dir: Path, name: str, data: dict[str, Any], plot: Callable[[Path], None] | None,
                            reading: Sequence[str | Path]) -> list[Path]:
    """:func:`~.output.write_result` (OUT/NAME.png and OUT/NAME.json, together) into ``out_dir``,
    created and marked first if new, and removed again if the write fails there: a full disk
    leaves no empty output behind. ``reading``: the sources, which ``out_dir`` must not be."""
    new = not Path(out_dir).exists()
    out_dir = claim_output_dir(out_dir, "eval", reading=reading)
    try:
        return write_result(out_dir, name, data, plot)
    except BaseException:
        if new:
            unclaim_output_dir(out_dir)
        raise


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
    overwrite: bool = False,
) -> SuiteResult:
    """Run every evaluation (or those named) on each checkpoint (label -> directory); ``options``
    overrides options per evaluation (``{"outliers": {"tokens": 4096}}``) over the default or
    ``quick`` budget. An earlier result of one of them in ``out_dir`` is refused before any work,
    or with ``overwrite`` replaced.

    ``scaling_runs`` ({attention, params, tokens, loss} dicts) adds the scaling fit; it is
    skipped otherwise, since one size per architecture cannot give a scaling law.
    """
    names = list(evaluations) if evaluations is not None else list(EVALUATIONS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown evaluation(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    written = [n for n in names if n in EVALUATIONS or (n == scaling.NAME and scaling_runs)]  # their results
    check_results_out(out_dir, written, overwrite=overwrite, reading=list(checkpoints.values()))  # before any work
    with lock_output(out_dir):  # one writer per output: a second suite or eval into out_dir is refused by pid
        check_results_out(out_dir, written, overwrite=overwrite, reading=list(checkpoints.values()))
        text = text or EvalText()
        models = [load_model(path, device=device, label=label) for label, path in checkpoints.items()]
        result = SuiteResult()
        model_names = [n for n in names if n in EVALUATIONS]
        for name in progress_bar(model_names, desc="evaluation suite", disable=not progress):
            spec = EVALUATIONS[name]
            chosen = evaluation_options(name, (options or {}).get(name), quick=quick)
            data, section, files = run_evaluation(spec, models, out_dir, options=chosen, text=text, progress=progress,
                                                  overwrite=overwrite)
            result.data[name], result.sections[name] = data, section
            result.files += files
            if data["models"]:
                result.images[name] = result_files(out_dir, name)[1]
        if scaling.NAME in names and scaling_runs:
            data = {"evaluation": scaling.NAME, "title": scaling.TITLE, **scaling.evaluate(scaling_runs)}
            result.files += write_evaluation_result(out_dir, scaling.NAME, data, lambda path: scaling.plot(data, path),
                                           list(checkpoints.values()))
            result.data[scaling.NAME], result.sections[scaling.NAME] = data, scaling.report(data)
            result.images[scaling.NAME] = result_files(out_dir, scaling.NAME)[1]
    return result


def report_sections(checkpoints: dict[str, Path], out_dir: Path, *, quick: bool = False,
                    **suite_options: Any) -> list[str]:
    """The evaluation step ``compare`` runs after training: the suite into OUT/eval, returned as
    Markdown sections for OUT/report.md (plot links relative to OUT)."""
    result = run_suite(checkpoints, Path(out_dir) / "eval", quick=quick, overwrite=True,  # its own earlier results
                       **suite_options)
    intro = ("## Evaluations of the paper\n\nEach section: our models (small, CPU-trained) beside the paper's figures "
             "(3B / 1.4B models). Only the direction of a difference can be compared; a sentence under each table "
             "says whether ours agrees with the paper. JSON and plots: eval/.")
    return [intro, result.markdown(relative_to=Path(out_dir))]
