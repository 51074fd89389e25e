"""The ``diff-transformer`` command. Each subcommand lives in its own module of this package,
which defines ``register(subparsers)``; COMMANDS lists them in the order --help shows them."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["generate", "info", "hf", "data", "evaluate", "train", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diff-transformer",
        description="Differential Transformer: train, compare, evaluate, benchmark and convert models.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
