"""diff-transformer generate: stream text from a checkpoint."""

from __future__ import annotations

import argparse
import sys

import torch

from . import args as types

DEFAULT_NEW_TOKENS = 200


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="stream text from a checkpoint",
        description="Stream a continuation of --prompt from a checkpoint directory, using the KV cache.",
    )
    p.add_argument("checkpoint", type=types.checkpoint_dir,
                   help="checkpoint directory (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prompt", default="", help="text to continue, after the tokenizer's begin token if it has one "
                   "(an imported Llama's or Motif's; default: start from the begin token, else end-of-text)")
    p.add_argument("--max-new-tokens", type=types.positive_int, default=None,
                   help=f"tokens to generate; the prompt and these must fit in the model's context (max_seq_len) "
                   f"(default {DEFAULT_NEW_TOKENS}, or as many as fit after the prompt)")
    p.add_argument("--temperature", type=types.nonnegative_float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=types.positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=types.probability, default=None,
                   help="nucleus sampling: smallest set with this mass")
    p.add_argument("--seed", type=types.seed, default=0, help="sampling seed (default 0)")
    p.add_argument("--tokenizer", type=types.tokenizer_spec, default=None,
                   help="tokenizer if the checkpoint has none ('bytes', 'default', a JSON file): the one the model was "
                   "trained with (its vocabulary the model's)")
    p.add_argument("--device", type=types.device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (compiling takes seconds first)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from ..checkpoint import read_config, tokenizer_for_model
    from ..generation import stream
    from ..model import LanguageModel

    try:  # the shell hands over bytes; those that are not UTF-8 arrive as lone surrogates
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"--prompt: {os.fsencode(args.prompt)!r} is not UTF-8 text") from None
    config, _ = read_config(args.checkpoint)  # the tokenizer and the prompt checked before the weights are read
    tokenizer = tokenizer_for_model(args.checkpoint, config.vocab_size, args.tokenizer, what="--tokenizer")
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer; pass --tokenizer")
    # A tokenizer with a begin token (a released model's) starts every sequence with it, as the model was
    # trained; this project's own tokenizers have none: a document starts after an end-of-text token.
    begin = getattr(tokenizer, "bos_id", None)
    start = [tokenizer.eos_id] if begin is None else [begin]
    prompt = ([] if begin is None else [begin]) + tokenizer.encode(args.prompt) if args.prompt else start
    context = config.max_seq_len
    room = context - len(prompt)
    if room <= 0:
        raise ValueError(f"--prompt: {len(prompt)} tokens (the model's context is {context})")
    if args.max_new_tokens is not None and args.max_new_tokens > room:
        tokens = f"{len(prompt)} token{'s' if len(prompt) > 1 else ''}"
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: the prompt ({tokens}) and "
                         f"{args.max_new_tokens} new tokens exceed the model's context of {context} tokens; "
                         f"at most {room} fit after this prompt")
    new_tokens = min(DEFAULT_NEW_TOKENS, room) if args.max_new_tokens is None else args.max_new_tokens
    model = LanguageModel.from_pretrained(args.checkpoint, device=args.device).eval()
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    generated: list[int] = []
    shown = ""
    sys.stdout.write(args.prompt)
    for step in stream(
        model, [prompt], new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, stop_tokens=[tokenizer.eos_id], generator=generator, compile=args.compile,
        vocab_limit=tokenizer.vocab_size,  # ids past the tokenizer's (a padded vocabulary) have no text
    ):
        token = int(step[0])
        if token == tokenizer.eos_id:
            break
        generated.append(token)
        text = tokenizer.decode(generated)
        if not text.endswith("\ufffd"):  # wait for a multi-byte character to complete
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tokenizer.decode(generated)[len(shown):] + "\n")
    return 0
