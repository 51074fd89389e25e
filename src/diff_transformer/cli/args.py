"""Argument types shared by every subcommand: each turns a command-line string into a value or
raises argparse.ArgumentTypeError with "VALUE is not ... (why)", which the parser reports as one
``error: argument --flag: ...`` line (see :func:`diff_transformer.cli.main`) before any work starts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..user_text import not_a_file

__all__ = [
    "UsageError", "positive_int", "nonnegative_int", "seed", "positive_float", "positive_float_list",
    "nonnegative_float", "probability", "unit_interval", "fraction", "device", "existing_file", "existing_dir",
    "checkpoint_dir", "tokenizer_spec", "output_dir", "output_file", "existing_path", "budget",
]

MAX_SEED = 2**63 - 1


class UsageError(SystemExit):
    """A command line the parser refuses. A SystemExit (status 2), as argparse's own exit is, so
    code that calls ``parse_args`` keeps working; :func:`diff_transformer.cli.main` catches it."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D401 - argparse's signature
        raise UsageError(f"{self.prog}: {message}")


def _fail(value: str, why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{value!r} is not valid ({why})")


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise _fail(value, "an integer is needed") from None


def _float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _fail(value, "a number is needed") from None
    if not math.isfinite(number):
        raise _fail(value, "a finite number is needed")
    return number


def positive_int(value: str) -> int:
    number = _int(value)
    if number < 1:
        raise _fail(value, "must be a positive integer")
    return number


def nonnegative_int(value: str) -> int:
    number = _int(value)
    if number < 0:
        raise _fail(value, "must be 0 or more")
    return number


def seed(value: str) -> int:
    number = _int(value)
    if not 0 <= number <= MAX_SEED:
        raise _fail(value, "a seed must be in [0, 2**63 - 1]")
    return number


def positive_float(value: str) -> float:
    number = _float(value)
    if number <= 0:
        raise _fail(value, "must be greater than 0")
    return number


def positive_float_list(value: str) -> list[float]:
    """"1e-3,2e-3" -> [0.001, 0.002]: one or more positive numbers, comma-separated."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise _fail(value, "comma-separated positive numbers are needed")
    try:
        return [positive_float(item) for item in items]
    except argparse.ArgumentTypeError:
        raise _fail(value, "every item must be a positive number") from None


def init_recipes(value: str) -> list[str]:
    """"scaled-init,plain-init" -> the init recipes (diff_transformer.experiments.config.INIT_RECIPES), each once."""
    from ..experiments.config import INIT_RECIPES

    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in items if item not in INIT_RECIPES]
    if not items or unknown or len(set(items)) != len(items):
        raise _fail(value, f"comma-separated init recipes, each once, from {', '.join(INIT_RECIPES)}")
    return items


def budget(value: str) -> dict[str, str | float]:
    """"flops=2e13" -> {"kind": "flops", "amount": 2e13}: run.budget (tokens, flops or seconds)."""
    from ..train.config import BUDGET_KINDS

    kind, sep, amount = value.partition("=")
    kind = kind.strip()
    if not sep or kind not in BUDGET_KINDS:
        raise _fail(value, f"KIND=AMOUNT with KIND one of {', '.join(BUDGET_KINDS)}, e.g. flops=2e13")
    try:
        return {"kind": kind, "amount": positive_float(amount.strip())}
    except argparse.ArgumentTypeError:
        raise _fail(value, f"the amount of {kind} must be a positive number") from None


def nonnegative_float(value: str) -> float:
    number = _float(value)
    if number < 0:
        raise _fail(value, "must be 0 or more")
    return number


def probability(value: str) -> float:
    """A probability mass in (0, 1] (top-p)."""
    number = _float(value)
    if not 0.0 < number <= 1.0:
        raise _fail(value, "must be in (0, 1]")
    return number


def unit_interval(value: str) -> float:
    """A position in [0, 1] (a needle's depth)."""
    number = _float(value)
    if not 0.0 <= number <= 1.0:
        raise _fail(value, "must be in [0, 1]")
    return number


def fraction(value: str) -> float:
    """A share in (0, 1): a validation split, which training needs non-empty."""
    number = _float(value)
    if not 0.0 < number < 1.0:
        raise _fail(value, "must be more than 0 and less than 1: train needs a validation split")
    return number


def device(value: str) -> str:
    """A torch device that exists on this machine: cpu, cuda, cuda:N, mps."""
    import torch

    try:
        parsed = torch.device(value)
    except (RuntimeError, ValueError):
        raise _fail(value, "a torch device is needed: cpu, cuda, cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise _fail(value, "CUDA is not available on this machine")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise _fail(value, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise _fail(value, "MPS is not available on this machine")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise _fail(value, "use cpu, cuda or cuda:N")
    return value


def existing_file(value: str) -> str:
    """A regular file that exists: a FIFO, socket or device (which a read would block on, or never
    finish), a broken link or a link loop is named as what it is."""
    what = not_a_file(value)
    if what == "no such file or folder":
        raise _fail(value, "no such file")
    if what is not None:
        raise _fail(value, f"{what}, not a file")
    if Path(value).is_dir():
        raise _fail(value, "a file is needed, this is a directory")
    return value


def existing_dir(value: str) -> str:
    path = Path(value)
    if not path.exists():
        raise _fail(value, "no such directory")
    if not path.is_dir():
        raise _fail(value, "a directory is needed, this is a file")
    return value


def checkpoint_dir(value: str) -> str:
    """A directory holding a checkpoint's config.json (what is inside is checked when it loads)."""
    path = Path(value)
    if not (path / "config.json").is_file():
        why = "no config.json" if path.is_dir() else (
            "a file, not a directory" if path.exists() else "no config.json, no such directory")
        raise argparse.ArgumentTypeError(f"{value}: not a checkpoint directory ({why})")
    return value


def tokenizer_spec(value: str) -> str:
    """'default', 'bytes', or a tokenizer file / checkpoint directory that exists."""
    if value in ("default", "bytes") or Path(value).exists():
        return value
    raise _fail(value, "give 'default', 'bytes', a tokenizers JSON file or a directory holding one; no such path")


def _writable_parent(value: str, what: str) -> str:
    path = Path(value)
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise _fail(value, f"{parent} is a file, so no {what} can be created under it")
            return value
    return value


def output_dir(value: str) -> str:
    """A directory to create or fill: not an existing file, not under a file."""
    if Path(value).is_file():
        raise _fail(value, "an output directory is needed, this is a file")
    return _writable_parent(value, "directory")


def output_file(value: str) -> str:
    """A file to write: not an existing directory, not under a file."""
    if Path(value).is_dir():
        raise _fail(value, "an output file is needed, this is a directory")
    return _writable_parent(value, "file")


def existing_path(value: str) -> str:
    """A file or directory that exists (an input); anything else named as what it is (:func:`existing_file`)."""
    what = not_a_file(value)
    if what == "no such file or folder":
        raise _fail(value, "no such file or directory")
    if what is not None:
        raise _fail(value, f"{what}, not a file or directory")
    return value


def bounded(kind: type, minimum: float | None = None, maximum: float | None = None):
    """An argument type for an int or float within [minimum, maximum] (either end may be open: None)."""
    convert = _int if kind is int else _float

    def parse(value: str):
        number = convert(value)
        if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
            low = "-inf" if minimum is None else minimum
            high = "inf" if maximum is None else maximum
            raise _fail(value, f"must be in [{low}, {high}]")
        return number

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
