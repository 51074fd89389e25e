"""diff-transformer export-hf / import-hf: move checkpoints to and from Hugging Face transformers."""

from __future__ import annotations

import argparse

from . import args as types


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export-hf",
        help="write a checkpoint as a transformers DiffLlama (DIFF) or Llama (standard) directory",
        description="Write CHECKPOINT as a directory that transformers.AutoModelForCausalLM.from_pretrained(OUT) "
        "loads as DiffLlamaForCausalLM (DIFF attention) or LlamaForCausalLM (standard attention): config.json, "
        "model.safetensors (fp32) and, when the checkpoint has one, the tokenizer as a PreTrainedTokenizerFast. "
        "DIFF V2, symmetric DIFF, gated attention, GDA, PolyNorm MLPs, biases, a constant or shifted lambda_init, DIFF "
        "without head norm and standard attention with head norm have no transformers equivalent and are refused. "
        "Needs the 'hf' extra.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", type=types.checkpoint_dir,
                        help="checkpoint directory of this project")
    export.add_argument("out", metavar="OUT", type=types.output_dir,
                        help="output directory: new or empty (an earlier export is replaced only with --overwrite)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it holds an earlier export of this project")
    export.set_defaults(run=run_export)

    imp = subparsers.add_parser(
        "import-hf",
        help="read a transformers Llama, DiffLlama or Motif directory into a checkpoint",
        description="Read DIR (config.json, model.safetensors or its sharded index, tokenizer.json) of a "
        "transformers Llama or DiffLlama model, or of Motif-2.6B / Motif-2-12.7B as released, into a checkpoint "
        "of this project at OUT. The tensors are checked against the model from the safetensors headers first, "
        "then read shard by shard and written one at a time (the memory held is about one tensor, not the model). "
        "Pickled weights (pytorch_model.bin), other Motif models (Motif-3) and anything not read exactly are "
        "refused by name. The tokenizer's end-of-text and begin tokens are those its tokenizer_config.json or "
        "config.json names (else <|endoftext|>), or --eos-token / --bos-token.",
    )
    imp.add_argument("directory", metavar="DIR", type=types.existing_dir, help="transformers model directory")
    imp.add_argument("out", metavar="OUT", type=types.output_dir,
                     help="output checkpoint directory: new or empty (a checkpoint of this project is replaced only "
                     "with --overwrite)")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if it holds a checkpoint of this project")
    imp.add_argument("--no-tokenizer", action="store_true", help="import the weights only, not tokenizer.json")
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="the checkpoint's weights (default float32; bfloat16 keeps a bf16 release as it is, at half "
                     "the size); the λ vectors stay float32")
    imp.add_argument("--eos-token", default=None, metavar="TOKEN",
                     help="the tokenizer's end-of-text token (default: as tokenizer_config.json or config.json in DIR "
                     "names it, else <|endoftext|>)")
    imp.add_argument("--bos-token", default=None, metavar="TOKEN",
                     help="the tokenizer's begin token (default: as tokenizer_config.json or config.json in DIR names "
                     "it, else none)")
    imp.set_defaults(run=run_import)


def run_export(args: argparse.Namespace) -> int:
    from ..interop.hf import export_hf

    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ..interop.hf import import_hf

    out = import_hf(args.directory, args.out, with_tokenizer=not args.no_tokenizer, overwrite=args.overwrite,
                    dtype=args.dtype, eos_token=args.eos_token, bos_token=args.bos_token)
    print(f"wrote {out}")
    return 0
