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
        "DIFF V2, a constant lambda_init, DIFF without head norm and standard attention with head norm have no "
        "transformers equivalent and are refused. Needs the 'hf' extra.",
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
        help="read a transformers DiffLlama or Llama directory into a checkpoint",
        description="Read DIR (config.json, model.safetensors or its sharded index, tokenizer.json) of a "
        "transformers DiffLlama or Llama model into a checkpoint of this project at OUT. Pickled weights "
        "(pytorch_model.bin) are refused. The tokenizer must contain <|endoftext|>; otherwise pass --no-tokenizer.",
    )
    imp.add_argument("directory", metavar="DIR", type=types.existing_dir, help="transformers model directory")
    imp.add_argument("out", metavar="OUT", type=types.output_dir,
                     help="output checkpoint directory: new or empty (a checkpoint of this project is replaced only "
                     "with --overwrite)")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if it holds a checkpoint of this project")
    imp.add_argument("--no-tokenizer", action="store_true", help="import the weights only, not tokenizer.json")
    imp.set_defaults(run=run_import)


def run_export(args: argparse.Namespace) -> int:
    from ..interop.hf import export_hf

    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ..interop.hf import import_hf

    out = import_hf(args.directory, args.out, with_tokenizer=not args.no_tokenizer, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
