"""diff-transformer eval NAME: the paper's evaluations on one or more checkpoints.

    diff-transformer eval needle --checkpoint out/compare/diff --checkpoint out/compare/standard
    diff-transformer eval quantization --checkpoint out/compare/diff --bits 8 6 4 --out out/quant
    diff-transformer eval icl --checkpoint DIR --data my.jsonl --text-field sentence --label-field label
    diff-transformer eval scaling --results runs.json
    diff-transformer eval position-nll --checkpoint SHORT --checkpoint EXTENDED --max-seq-len 1024

Each writes OUT/NAME.json and OUT/NAME.png (both or neither) and prints the Markdown report; an
earlier result of the same evaluation in OUT is replaced only with --overwrite, and a second
command writing into OUT at the same time is refused with the first one's pid. An evaluation that
cannot run on one of the models (a context too short for its settings, an empty text) is one
``error:`` line naming the model and why, exit status 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..checks import MAX_SEQ_LEN
from ..evaluation.output import DEFAULT_OUT
from ..files import lock_output
from . import args as types
from .args import bounded

# Evaluations that read no held-out text (their own data or generated tasks): --text is refused, not ignored.
NO_TEXT = ("context-qa", "icl", "mqar")


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..evaluation import EVALUATIONS
    from ..evaluation import scaling

    p = subparsers.add_parser(
        "eval",
        help="run one of the paper's evaluations on checkpoints",
        description="Run one of the paper's evaluations on one or more checkpoints (any attention kind). "
        "Writes OUT/NAME.json and OUT/NAME.png and prints a Markdown report with the paper's figures beside ours.",
    )
    names = p.add_subparsers(dest="evaluation", required=True, metavar="NAME")
    for name, spec in EVALUATIONS.items():
        sub = names.add_parser(name, help=spec.title, description=f"{spec.title}. " + _first_paragraph(spec.run))
        _common_flags(sub, checkpoint_required=True)
        sub.add_argument("--quick", action="store_true", help="a small budget (smoke test); flags below still apply")
        add_option_flags(sub, spec.options_type)
        sub.set_defaults(run=run_model_evaluation, spec=spec)
    sub = names.add_parser(
        scaling.NAME, help=scaling.TITLE,
        description=f"{scaling.TITLE}: fit L(x) = a·x^(−b) + c per architecture from several runs (the runs of one "
        "kind at one x are its seeds), flag the laws the runs do not identify, and report the fraction of "
        "parameters (or tokens) each kind needs to reach the Transformer's loss, with its interval, or why it is "
        "not identified. Runs come from --results files (a scaling study's metrics.json gives the study's own "
        "figures) and/or --checkpoint directories (validation loss measured on held-out text).",
    )
    _common_flags(sub, checkpoint_required=False)
    sub.add_argument("--results", nargs="+", default=[], metavar="FILE", type=types.existing_file,
                     help="JSON: a list of {attention, params, tokens, loss, seed}, {\"runs\": [...]} (a scaling "
                     "study's metrics.json), or a compare metrics.json")
    sub.add_argument("--x", choices=scaling.X_KINDS, default="params", help="scale variable (default: params)")
    sub.add_argument("--resamples", type=bounded(int, 100), default=2000, metavar="N",
                     help="resamples of each fraction's interval (default: 2000, as a scaling study's "
                     "scaling.bootstrap_resamples)")
    sub.add_argument("--windows", type=types.positive_int, default=16,
                     help="held-out windows for a checkpoint's loss (default: 16)")
    sub.set_defaults(run=run_scaling)


def _first_paragraph(function) -> str:
    module = sys.modules[function.__module__]
    doc = (module.__doc__ or "").strip().split("\n\n")
    return " ".join(doc[1].split()) if len(doc) > 1 else ""


def _common_flags(p: argparse.ArgumentParser, *, checkpoint_required: bool) -> None:
    p.add_argument("--checkpoint", action="append", required=checkpoint_required, default=[], metavar="DIR",
                   help="checkpoint directory; repeat to evaluate several models together")
    p.add_argument("--label", action="append", default=[],
                   help="a name per --checkpoint, in order (default: KIND:DIRNAME, the run folder for RUN/checkpoint)")
    p.add_argument("--out", default=str(DEFAULT_OUT), type=types.output_dir,
                   help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier result of this evaluation in --out (refused without it)")
    p.add_argument("--tokenizer", default=None, type=types.tokenizer_spec,
                   help="tokenizer for checkpoints without one ('bytes', 'default', a JSON file): the one the model "
                   "was trained with (its vocabulary the model's)")
    p.add_argument("--text", default=None, metavar="FILE", type=types.existing_file,
                   help="held-out text file to evaluate on (default: the embedded corpus' validation documents); "
                   f"refused by {', '.join(NO_TEXT)}, which read none")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=types.device,
                   help="cpu, cuda or cuda:N")
    p.add_argument("--max-seq-len", type=bounded(int, 1, MAX_SEQ_LEN), default=None, metavar="N",
                   help="read every checkpoint at a context of N tokens instead of its own (the weights do not "
                        "depend on it): a short model beyond its training length, before and after train --init-from")
    p.add_argument("--rope-theta", type=types.positive_float, default=None, metavar="THETA",
                   help="RoPE base for every checkpoint instead of its own (default: each checkpoint's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _load(args: argparse.Namespace):
    from ..evaluation import EvalText, load_model
    from ..user_text import InputError, read_text_file

    if args.label and len(args.label) != len(args.checkpoint):
        raise ValueError(f"{len(args.label)} --label for {len(args.checkpoint)} --checkpoint (give one per checkpoint)")
    for directory in args.checkpoint:  # every path is checked before the first model loads
        try:
            types.checkpoint_dir(directory)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--checkpoint {exc}") from None
    labels = args.label or [None] * len(args.checkpoint)
    models = [load_model(c, device=args.device, tokenizer=args.tokenizer, label=label, max_seq_len=args.max_seq_len,
                         rope_theta=args.rope_theta) for c, label in zip(args.checkpoint, labels)]
    if len({m.label for m in models}) != len(models):
        raise ValueError("two checkpoints have the same label (give --label for each)")
    text = None
    if args.text:
        try:
            text = EvalText([read_text_file(args.text, nonempty=True)])
        except InputError as exc:
            raise InputError(f"--text {exc}") from None
    return models, text or EvalText()


def run_model_evaluation(args: argparse.Namespace) -> int:
    """Run the evaluation on every model, or write nothing (an EvaluationError names the model)."""
    from pathlib import Path

    from ..evaluation import run_evaluation
    from ..evaluation.suite import check_results_out

    spec = args.spec
    if args.text is not None and spec.name in NO_TEXT:
        raise types.UsageError(f"diff-transformer eval {spec.name}: --text is not read by {spec.name} (it reads "
                               f"{'--data' if spec.name != 'mqar' else 'generated tasks'}); leave it out")
    options = options_from_flags(spec.options_type, args, spec.options_type.quick() if args.quick else None)
    out = Path(args.out)
    check_results_out(out, [spec.name], overwrite=args.overwrite, reading=args.checkpoint)  # before any model loads
    with lock_output(out):  # one writer per output, from before the models load to the last file
        models, text = _load(args)
        _, section, files = run_evaluation(spec, models, out, options=options, text=text,
                                           progress=not args.no_progress, strict=True, overwrite=args.overwrite)
    print(f"## {spec.title}\n\n{section}\n")
    for path in files:
        print(f"wrote {path}")
    return 0


def run_scaling(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..evaluation import scaling
    from ..evaluation.suite import check_results_out, write_evaluation_result

    reading = [*(args.checkpoint or ()), *(args.results or ())]
    check_results_out(Path(args.out), [scaling.NAME], overwrite=args.overwrite, reading=reading)  # before any work
    with lock_output(args.out):  # one writer per output
        check_results_out(Path(args.out), [scaling.NAME], overwrite=args.overwrite, reading=reading)
        runs = scaling.load_runs(args.results)
        if args.checkpoint:
            models, text = _load(args)
            runs += [scaling.run_from_checkpoint(m, text, windows=args.windows) for m in models]
        if not runs:
            raise ValueError("nothing to fit (give --results FILE and/or --checkpoint DIR)")
        result = {"evaluation": scaling.NAME, "title": scaling.TITLE,
                  **scaling.evaluate(runs, args.x, resamples=args.resamples)}
        files = write_evaluation_result(Path(args.out), scaling.NAME, result, lambda path: scaling.plot(result, path),
                                        reading)
    print(f"## {scaling.TITLE}\n\n{scaling.report(result)}\n")
    print("\n".join(f"wrote {path}" for path in files))
    return 0


# --- one flag per option of an evaluation ----------------------------------------------------------


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
                                metavar=f.metadata.get("metavar", f.name.upper()), choices=f.metadata.get("choices"))


def options_from_flags(options_type: type, args: Any, base: Any = None) -> Any:
    """``base`` (default: the type's defaults) with every flag the user gave applied."""
    options = base if base is not None else options_type()
    given = {}
    for f in dataclasses.fields(options_type):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(options, **given)
