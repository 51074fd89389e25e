"""diff-transformer tokenizer train / diff-transformer prepare: tokenizers and token shards.

``prepare`` stops on SIGINT or SIGTERM (exit status 130 or 143): the signal is raised in the main
process as :class:`Interrupted`, so that every clean-up on the way out runs (the tokenizing
processes ended, the temporary directory and the lock removed); a second signal during that
clean-up is ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from typing import Iterator

from . import args as types

INPUT_HELP = ("a text file, a file of records (.jsonl, .jsonl.gz, .jsonl.xz, .jsonl.zst: JSON Lines; .json: an "
              "object or a list of objects, else JSON Lines; .parquet; .arrow), or a folder of them (.txt .text .md "
              ".rst and records; a datasets.save_to_disk folder: its data files in order)")
TEXT_FIELD_HELP = "field holding the text in records (JSON, Parquet and Arrow columns; default 'text')"


def register(subparsers: argparse._SubParsersAction) -> None:
    tokenizer = subparsers.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on your text",
        description="Tokenizer tools. The shipped BPE (vocab 8192) and the raw-byte tokenizer need no training.",
    )
    actions = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = actions.add_parser(
        "train",
        help="train a byte-level BPE with an <|endoftext|> token",
        description="Train a byte-level BPE (Hugging Face tokenizers) on text files, folders or records (as prepare "
        "reads them) and "
        "write it as a tokenizers JSON file, usable as `prepare --tokenizer FILE`.",
    )
    train.add_argument("--input", nargs="+", required=True, type=types.existing_path, metavar="PATH",
                       help=INPUT_HELP + " (one or more)")
    train.add_argument("--vocab-size", type=types.positive_int, default=8192,
                       help="vocabulary size incl. 256 bytes and <|endoftext|> (default 8192)")
    train.add_argument("--out", required=True, type=types.output_file, metavar="FILE",
                       help="tokenizer JSON file to write")
    train.add_argument("--text-field", default="text", help=TEXT_FIELD_HELP)
    train.add_argument("--min-frequency", type=types.positive_int, default=2,
                       help="merge only pairs seen this often (default 2)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace --out if it is a tokenizers JSON file (no other file)")
    train.set_defaults(run=run_tokenizer_train)

    prepare = subparsers.add_parser(
        "prepare",
        help="tokenize text into train/validation token shards",
        description="Tokenize text files, folders, or records (JSON Lines, plain or compressed; JSON; Parquet; "
        "Arrow and datasets.save_to_disk folders) into DIR/train.bin and DIR/val.bin "
        "(uint16 or uint32 token ids, each document followed by the end-of-text token) plus DIR/meta.json and the "
        "tokenizer. The split is by document, deterministic given --seed. DIR is written atomically, by one "
        "process at a time, and never replaced without --overwrite.",
    )
    prepare.add_argument("inputs", nargs="+", type=types.existing_path, metavar="INPUT", help=INPUT_HELP)
    prepare.add_argument("--out", required=True, type=types.output_dir, metavar="DIR",
                         help="dataset directory to create")
    prepare.add_argument("--tokenizer", default="default", type=types.tokenizer_spec,
                         help="'default' (shipped BPE, vocab 8192), 'bytes' (raw UTF-8 bytes, vocab 257), "
                         "or a tokenizers JSON file, e.g. a Llama, Qwen or Motif tokenizer.json (default 'default')")
    prepare.add_argument("--eos-token", default=None, metavar="TOKEN",
                         help="the tokenizer file's end-of-text token, which ends every document (default: as "
                         "tokenizer_config.json (eos_token) or config.json (eos_token_id) beside it names it, else "
                         "<|endoftext|>)")
    prepare.add_argument("--bos-token", default=None, metavar="TOKEN",
                         help="the tokenizer file's begin token, kept with the dataset's tokenizer (default: as "
                         "tokenizer_config.json or config.json beside it names it, else none); documents are "
                         "not prefixed with it")
    prepare.add_argument("--text-field", default="text", help=TEXT_FIELD_HELP)
    prepare.add_argument("--val-fraction", type=types.fraction, default=0.05,
                         help="share of the bytes held out for validation, more than 0 and less than 1: whole "
                         "documents in a seeded order, or the tail of one document if none fits (default 0.05)")
    prepare.add_argument("--seed", type=types.seed, default=0, help="seed of the document split (default 0)")
    prepare.add_argument("--workers", type=types.positive_int, default=None, metavar="N",
                         help="tokenizing processes (default: one per core, fewer for a corpus under a few batches "
                         "of 4M characters); the dataset is the same for any number")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace DIR if it holds a dataset prepared by this project")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(run=run_prepare)


def run_tokenizer_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..data.bpe import check_tokenizer_out, save_tokenizer_file, train_bpe
    from ..data.inputs import check_output_outside_inputs, scan_documents
    from ..files import lock_output

    out = check_tokenizer_out(Path(args.out), overwrite=args.overwrite)  # before the work
    check_output_outside_inputs(out, args.input, "tokenizer")  # a .json there would be read as records
    with lock_output(out):  # one writer: a second `tokenizer train --out` the same file is refused before its work
        documents = scan_documents(args.input, args.text_field)
        start = time.perf_counter()
        # tokenizers draws its bar on a terminal; into a pipe or a file it writes only blank lines
        tokenizer = train_bpe(documents.texts(), args.vocab_size,
                              min_frequency=args.min_frequency, show_progress=sys.stdout.isatty())
        save_tokenizer_file(tokenizer, out, overwrite=args.overwrite)
    size = documents.total_bytes
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens on {len(documents)} documents "
          f"({size:,} bytes) in {time.perf_counter() - start:.1f} s -> {out}")
    return 0


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, received by a command that stops on either (:func:`stopping_on_signals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise :class:`Interrupted` in the main thread; a second
    signal (while the first one's clean-up runs) is ignored."""
    received: list[int] = []

    def stop(signum, frame) -> None:
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_prepare(args: argparse.Namespace) -> int:
    from ..data.prepare import prepare

    try:
        with stopping_on_signals():
            meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                           val_fraction=args.val_fraction, seed=args.seed, overwrite=args.overwrite,
                           progress=not args.quiet, workers=args.workers, eos_token=args.eos_token,
                           bos_token=args.bos_token)
    except Interrupted as stop:
        sys.stderr.write(f"interrupted by {stop}: prepare stopped, and {args.out} is as it was (nothing written)\n")
        return 128 + stop.signum
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    seconds = meta["seconds"]  # to the millisecond: a rate over less than a second says nothing
    rate = (f"{tokens / seconds:,.0f} tokens/s ({meta['bytes'] / seconds / 1e6:.2f} MB/s)" if seconds >= 1
            else "in under a second")
    print(f"{args.out}: {meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val tokens ({meta['dtype']}) "
          f"from {meta['documents']} documents, {meta['bytes']:,} bytes; "
          f"{meta['bytes'] / tokens:.2f} bytes/token, {rate}")
    return 0
