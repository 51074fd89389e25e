"""A study's output folder: new, continued, or replaced, and never another study's by accident.

``compare --out DIR`` into a folder that holds a study (its marker says "compare"):

- without ``--resume`` or ``--overwrite``: refused, naming the folder and both options (as
  ``train`` refuses a folder holding a run);
- ``--resume`` continues it only if it is the same study: the study's resolved config (DIR/config.yaml,
  with the command line's choices in it: models, seeds, learning rates, recipes, retrieval) is compared
  field by field with the one written when the study started, and every field that changes the runs and
  differs is named (:func:`study_differences`); logging, evaluation, paths, device and backend may
  change, as for ``train --resume``;
- ``--overwrite`` replaces it as a whole, and only if everything in it is what a study writes
  (:func:`foreign_study_entries`: the user's files are never deleted). The earlier study is moved aside,
  to ``.DIR.replaced`` beside DIR, and deleted once the new one completes; until then (a replacement
  that stopped) it is kept there, whole, and said so.

    check_study_output(out, record, resume=False, overwrite=False)   # before any work: refusals
    with open_study(out, record, resume=False, overwrite=False):     # claimed, locked, config.yaml
        ...                                                            # the study's runs and report
"""

from __future__ import annotations

import contextlib
import fnmatch
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml

from ..files import (
    LOCK_FILE, OUTPUT_MARKER, REPLACED_OUTPUT_FILES, OutputPathError, check_output_dir, check_unlocked,
    claim_output_dir, foreign_entries, lock_output_dir, project_output_kind, write_text_atomically,
)
from ..train.state import FREE, RESUME_RULES

CONFIG_FILE = "config.yaml"  # the study's resolved config: what --resume compares
# What a study writes itself, beside the runs, checkpoints and evaluation results it holds (fnmatch
# patterns): its config, report, metrics (and each retrieval run's or conversion's JSON), plots, locks.
STUDY_FILES = (CONFIG_FILE, "report.md", "*.json", "*.png", LOCK_FILE, ".*.lock", OUTPUT_MARKER)
# Fields of a study's config that --resume may change: those a resumed training run may change
# (train.state.RESUME_RULES: names, logging, evaluation, paths, device, backend), how many runs train
# at once, and the evaluations (run again on every resume) with the note that describes the budget.
STUDY_FREE = ("compare.jobs", "compare.budget_note", "compare.evaluations", "compare.evaluation_options",
              "compare.evaluation_models")


class StudyMismatch(OutputPathError):
    """--resume of a folder holding another study (the message names each field that differs)."""


def aside_path(out_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the earlier study until the new one completes: ``.NAME.replaced``."""
    out_dir = Path(out_dir).absolute()
    return out_dir.with_name(f".{out_dir.name}.replaced")


def _free(key: str) -> bool:
    """Whether the dotted field ``key`` of a study's config may change on --resume."""
    if key in STUDY_FREE or any(key.startswith(f"{field}.") for field in STUDY_FREE):
        return True
    parts = key.split(".")
    if parts[0] == "models":  # models.<name>.<field>...: the entry's rules
        rule = RESUME_RULES["models"].get(parts[2]) if len(parts) > 2 else None
        return rule == FREE
    rules: Any = RESUME_RULES
    for part in parts:
        if not isinstance(rules, dict) or part not in rules:
            return False
        rules = rules[part]
    return rules == FREE


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(data, dict) or not data and prefix:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def study_differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each field of a study's config that differs between ``before`` (DIR/config.yaml) and ``now`` and
    changes the runs: "FIELD: BEFORE -> NOW" ("unset" for a field one of them lacks); the sections'
    fields before the models' (an optim field set for every model also unsets each model's own)."""
    old, new = _flatten(before), _flatten(now)
    missing = object()
    differing = []
    for key in list(old) + [k for k in new if k not in old]:
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b and not _free(key):
            shown = ["unset" if v is missing else repr(v) for v in (a, b)]
            differing.append(f"{key}: {shown[0]} -> {shown[1]}")
    return sorted(differing, key=lambda line: line.startswith("models."))


def foreign_study_entries(out_dir: Path) -> list[str]:
    """What ``out_dir``, a study's folder, holds that no study writes there (paths relative to it,
    sorted): replacing the study would delete them. Its runs and checkpoints may hold only their own
    files (files.REPLACED_OUTPUT_FILES); any other folder only what a study writes (STUDY_FILES), the
    folders of its runs, checkpoints and evaluations; links and other kinds of project output (a
    dataset put there) are foreign too."""
    found: list[str] = []

    def walk(directory: Path, prefix: str) -> None:
        for entry in sorted(directory.iterdir()):
            name = f"{prefix}{entry.name}"
            if entry.is_symlink():
                found.append(name)
            elif entry.is_dir():
                kind = project_output_kind(entry)
                if kind in REPLACED_OUTPUT_FILES and kind != "hf-export":
                    found.extend(f"{name}/{inner}" for inner in foreign_entries(entry, kind))
                    checkpoint = entry / "checkpoint"
                    if kind == "train-run" and checkpoint.is_dir() and not checkpoint.is_symlink():
                        found.extend(f"{name}/checkpoint/{inner}" for inner in foreign_entries(checkpoint,
                                                                                               "checkpoint"))
                elif kind in (None, "compare", "eval"):
                    walk(entry, f"{name}/")
                else:
                    found.append(name)
            elif not any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in STUDY_FILES):
                found.append(name)

    walk(Path(out_dir), "")
    return found


def _holds_study(out_dir: Path) -> bool:
    return out_dir.is_dir() and any(out_dir.iterdir()) and project_output_kind(out_dir) == "compare"


def check_study_output(out_dir: Path, record: dict[str, Any], *, resume: bool, overwrite: bool,
                       reading: Iterable[str | Path] = ()) -> None:
    """Every refusal :func:`open_study` would give, before any work: ``out_dir`` new, empty, or a
    study's folder that ``resume`` continues (the same study: ``record``, its resolved config, equal
    to DIR/config.yaml but for STUDY_FREE fields) or ``overwrite`` replaces (nothing in it but what a
    study writes); never a folder another process is writing, one the study reads (``reading``), the
    current directory, or anything the project did not write."""
    out_dir = Path(out_dir)
    if resume and overwrite:
        raise OutputPathError(f"{out_dir}: --resume continues the study there and --overwrite replaces it; "
                              "give one of them")
    check_unlocked(out_dir / LOCK_FILE, f"{out_dir}: in use by another diff-transformer process")
    check_output_dir(out_dir, "compare", reuse=resume, overwrite=overwrite, reading=reading,
                     hint="pass --resume to continue that study, or --overwrite to replace it (or choose "
                     "another --out)")
    if not _holds_study(out_dir):
        return
    if resume:
        saved = out_dir / CONFIG_FILE
        if saved.is_file():
            try:
                before = yaml.safe_load(saved.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
                raise StudyMismatch(f"{saved}: unreadable ({exc}); --resume cannot tell whether {out_dir} holds "
                                    "this study: --overwrite to replace it, or choose another --out") from None
            differing = study_differences(before if isinstance(before, dict) else {}, record)
            if differing:
                shown = "; ".join(differing[:8]) + (f"; and {len(differing) - 8} more" if len(differing) > 8 else "")
                raise StudyMismatch(f"{out_dir}: --resume continues the study it holds, and this one differs: "
                                    f"{shown}. Resume with the settings it was started with, or --overwrite to "
                                    "replace it, or choose another --out")
    if overwrite:
        foreign = foreign_study_entries(out_dir)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise OutputPathError(f"{out_dir}: holds a diff-transformer comparison and also {shown}, which no study "
                                  "writes and --overwrite would delete with it; move them out, or choose another "
                                  "--out")


@contextlib.contextmanager
def open_study(out_dir: Path, record: dict[str, Any], *, resume: bool, overwrite: bool,
               reading: Iterable[str | Path] = (), progress: bool = True) -> Iterator[Path]:
    """The study's folder, checked (:func:`check_study_output`), created and marked, locked while the
    block runs (DIR/.lock: one study at a time in it), with ``record`` written to DIR/config.yaml.
    With ``overwrite`` an earlier study there is moved aside (:func:`aside_path`) and deleted when the
    block completes; a block that raises (an error, an interrupt) leaves it there, whole."""
    out_dir = Path(out_dir)
    reading = list(reading)
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=reading)
    aside = aside_path(out_dir)
    if overwrite and _holds_study(out_dir):
        with lock_output_dir(out_dir):  # nobody else writes into it while it moves
            if aside.exists():  # an earlier replacement that never completed: its partial study goes
                check_output_dir(aside, "compare", overwrite=True)
                shutil.rmtree(out_dir)
            else:
                out_dir.rename(aside)
                (aside / LOCK_FILE).unlink(missing_ok=True)  # this process's lock, moved with the folder
        if progress:
            print(f"{out_dir}: the earlier study moved to {aside}, deleted once this one completes",
                  file=sys.stderr, flush=True)
    claim_output_dir(out_dir, "compare", reading=reading)
    with lock_output_dir(out_dir):
        write_text_atomically(out_dir / CONFIG_FILE, yaml.safe_dump(record, sort_keys=False))
        try:
            yield out_dir
        except BaseException:
            if aside.is_dir():
                print(f"note: {out_dir}: the study it replaces is kept in {aside} until this one completes",
                      file=sys.stderr, flush=True)
            raise
    if aside.is_dir() and (overwrite or resume) and project_output_kind(aside) == "compare":
        shutil.rmtree(aside)
