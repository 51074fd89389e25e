"""diff-transformer convert SOURCE OUT: a DIFF model from a pretrained Transformer (diff_transformer.convert)."""

from __future__ import annotations

import argparse
import json

from . import args as types


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..convert import INITS, START_WINDOW_TOKENS, START_WINDOWS, TARGETS

    p = subparsers.add_parser(
        "convert",
        help="turn a pretrained Transformer (a standard checkpoint or a transformers Llama) into a DIFF checkpoint",
        description="Convert SOURCE, a standard-attention checkpoint of this project or a transformers "
        "LlamaForCausalLM directory, into a checkpoint of this project at OUT that train --init-from fine-tunes "
        "and every evaluation reads, with the source's tokenizer. --init exact (the default): the converted model "
        "computes the source's function (each source head is a DIFF head's first map, the second maps are new and "
        "λ starts at exactly 0; no head norm, value width d); --init split: the matched DIFF (the source's heads "
        "paired into DIFF heads of two groups and a 2d-wide value), not equal at step 0. --to diff_v2 is exact "
        "(the second query of each head a copy of the first, the gate at 1/2, o_proj doubled). Prints the "
        "parameters added and, on held-out windows, both models' loss and the largest logit difference; "
        "OUT/config.json records them under converted_from. OUT must be new or empty.",
    )
    p.add_argument("source", metavar="SOURCE", type=types.existing_dir,
                   help="a standard (Transformer) checkpoint directory of this project, or a transformers "
                   "LlamaForCausalLM directory (config.json, model.safetensors)")
    p.add_argument("out", metavar="OUT", type=types.output_dir, help="output checkpoint directory: new or empty")
    p.add_argument("--to", choices=TARGETS, default="diff", help="the attention kind to convert to (default: diff)")
    p.add_argument("--init", choices=INITS, default="exact",
                   help="exact: the source's function at step 0 (default); split: parameter-matched DIFF, heads paired")
    p.add_argument("--seed", type=types.seed, default=0, help="seed of the new parameters (default: 0)")
    p.add_argument("--windows", type=types.positive_int, default=START_WINDOWS, metavar="N",
                   help=f"held-out windows of up to {START_WINDOW_TOKENS} tokens the step-0 comparison scores "
                   f"(default: {START_WINDOWS})")
    p.add_argument("--text", metavar="FILE", type=types.existing_file,
                   help="UTF-8 text the windows are taken from (default: the embedded corpus' validation documents)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="leave the source's tokenizer out (the windows are then random tokens)")
    p.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from ..convert import TooLittleText, convert_checkpoint
    from ..user_text import InputError, read_text_file

    text = None
    if args.text:
        try:
            text = read_text_file(args.text, nonempty=True)
        except InputError as exc:
            raise InputError(f"--text {exc}") from None
    try:
        result = convert_checkpoint(args.source, args.out, to=args.to, init=args.init, seed=args.seed,
                                    with_tokenizer=not args.no_tokenizer, windows=args.windows, text=text)
    except TooLittleText as exc:  # said with the options that set the text and the windows
        source = f"--text {args.text} holds" if args.text else "the embedded corpus' validation documents hold"
        raise ValueError(f"{source} {exc.tokens:,} tokens, too few for --windows {exc.count:,} windows of "
                         f"{exc.window} tokens ({exc.needed:,} needed; at most {exc.tokens // exc.window:,} "
                         f"windows fit): give {'more text' if args.text else 'a longer --text'} or fewer "
                         "--windows") from None
    conversion, start = result.conversion, result.start
    share = conversion.added_parameters / conversion.source_parameters
    lines = [
        f"wrote {result.path}: {conversion.to} ({conversion.init}) from the {result.source_kind} {result.source}",
        f"parameters: {conversion.source_parameters:,} -> {conversion.parameters:,}, "
        f"{conversion.added_parameters:,} added ({share:.2%}):",
        *(f"  {what}: {count:,}" for what, count in conversion.added.items()),
        f"at step 0, on {start.windows} windows of {start.window_tokens} tokens of {start.text}: loss "
        f"{start.source_loss:.4f} (source) -> {start.converted_loss:.4f} (converted), change {start.loss_change:+.4f}; "
        f"largest logit difference {start.max_logit_difference:.2e}",
        "fine-tune it with train --init-from " + str(result.path) + ", the model entry set to the source's but for: "
        + " ".join(f"{name}={json.dumps(value)}" for name, value in result.finetune_fields.items())
        + " (e.g. --set models.NAME.FIELD=VALUE)",
    ]
    print("\n".join(lines))
    return 0
