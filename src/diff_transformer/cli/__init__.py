"""The ``diff-transformer`` command. Each subcommand lives in its own module of this package,
which defines ``register(subparsers)``; COMMANDS lists them in the order --help shows them.

Errors are answered here, for every command: a bad option value is refused by the parser
(argument types in :mod:`.args`) before any work starts, and a bad path or file met later
(a project error, ValueError or OSError) ends the command too; either way one line
``error: <what> (<why>)`` goes to stderr and the exit status is 2. Anything else is a bug: one
``error: unexpected ...`` line and exit status 1. ``--debug`` (or DIFF_TRANSFORMER_DEBUG=1)
shows the traceback instead.

SIGINT, SIGTERM and SIGHUP (a closed terminal) that reach a command outside the work that handles
them itself (a training loop saves a checkpoint, a study's runner stops its runs) end it with one
line, "interrupted by SIGNAL" and what to do next (INTERRUPTED_HINTS), and the exit status a shell
gives a process the signal stopped, 130, 143 or 129: while it loads torch, checks its inputs, tokenizes.
The package imports torch on first use, so the command's first second is inside this handling too.

The command comes with the train extra (:mod:`diff_transformer.extras`): every command but those of
CORE_COMMANDS checks that the extra's libraries are installed before it starts, and a library of
another extra found missing later (transformers for ``hf``) is named with the extra that installs
it; either way exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Iterator

from ..extras import MissingExtraError, extra_of, install_command, missing_distributions, missing_extra_message
from ..files import ENDING_SIGNALS
from .args import Parser, UsageError

COMMANDS = ["generate", "info", "hf", "convert", "data", "evaluate", "train", "bench"]
DEBUG_ENV = "DIFF_TRANSFORMER_DEBUG"
CORE_COMMANDS = ("info", "bench")  # need the core alone (bench's comparison with transformers: where installed)
# What to do after a signal ended a command outside the work that handles it (see the docstring), by command.
INTERRUPTED_HINTS = {
    "train": "the run stopped without saving a checkpoint (its last one, if any, is intact)",
    "compare": "rerun the same command with --resume to continue (the runs that finished are kept)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diff-transformer",
        description="Differential Transformer: train, compare, evaluate, benchmark and convert models.",
        epilog=f"Bad input ends with one 'error:' line and exit status 2; --debug or {DEBUG_ENV}=1 shows tracebacks.",
    )
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or set {DEBUG_ENV}=1)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def _debugging(argv: list[str]) -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no") or "--debug" in argv


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises: the project's error types (ValueError subclasses mostly), OSError."""
    from safetensors import SafetensorError

    from ..train.trainer import TrainingError

    return (ValueError, OSError, SafetensorError, TrainingError)


class Interrupted(KeyboardInterrupt):
    """A signal that ends a command (SIGINT, SIGTERM or SIGHUP while :func:`main` answers them): ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` where the command is; while torch loads they are
    held (raised in the middle of a C extension's import, they abort the process or leave the import
    half done) and raised as soon as it has loaded."""

    def __init__(self) -> None:
        self.holding = False
        self.held: int | None = None

    def handle(self, signum, frame) -> None:
        if self.holding:
            self.held = self.held or signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers within the block (where the signal was not ignored when the command started:
        ``nohup``, a shell's background job), the previous ones after it."""
        previous = {}
        if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
            for signum in ENDING_SIGNALS:
                if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    previous[signum] = signal.signal(signum, self.handle)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """Signals within the block raised when it ends."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held is not None:
            raise Interrupted(self.held)


def main(argv: list[str] | None = None) -> int:
    signals = _Signals()
    with signals.installed():
        return _main(argv, signals)


def _main(argv: list[str] | None, signals: _Signals) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debugging(argv)
    command = "diff-transformer"  # and the subcommand, once parsed
    try:
        with signals.held_back():
            args = build_parser().parse_args(argv)
            import torch  # noqa: F401 (loaded here, where a signal waits for it: see _Signals)
        command = f"diff-transformer {args.command}"
        missing = [] if args.command in CORE_COMMANDS else missing_distributions("train")
        if missing:  # before any work: a library met halfway would leave the work half done
            _error_line(f"{command} needs the train extra, and {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not installed: {install_command('train')}")
            return 2
        return int(args.run(args) or 0)
    except UsageError as exc:
        _error_line(str(exc))
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        hint = INTERRUPTED_HINTS.get(next((a for a in argv if not a.startswith("-")), ""))
        sys.stderr.write(f"interrupted by {signal.Signals(signum).name}{f': {hint}' if hint else ''}\n")
        sys.stderr.flush()
        return 128 + signum
    except SystemExit:
        raise  # --help, --version
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, ModuleNotFoundError) and exc.name and extra_of(exc.name):
            # import_optional's error says what needed the library; a plain import's, the command
            _error_line(str(exc) if isinstance(exc, MissingExtraError) else missing_extra_message(exc.name, command))
            return 2
        if isinstance(exc, _input_errors()):
            _error_line(_describe(exc))
            return 2
        _error_line(f"unexpected {type(exc).__name__}: {exc} (a bug? rerun with --debug for the traceback)")
        return 1


def _error_line(message: str) -> None:
    """"error: MESSAGE" and its newline in one write: under torchrun every rank writes to the same
    stderr, and print's two writes (text, then newline) let the ranks' lines run into each other."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _describe(exc: BaseException) -> str:
    """The message of an error; an OSError as "PATH: reason" (the file it names, the OS's words)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        second = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{second}: {exc.strerror}"
    return str(exc) or type(exc).__name__
