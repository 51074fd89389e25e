"""diff-transformer export-hf / import-hf: move checkpoints to and from Hugging Face transformers."""

from __future__ import annotations

import argparse

from . import args as types


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export-hf",
        help="write a checkpoint as a transformers directory (DiffLlama, Llama or remote code) or in Motif's layout",
        description="Write CHECKPOINT as a directory that transformers.AutoModelForCausalLM.from_pretrained(OUT) "
        "loads: DiffLlamaForCausalLM (DIFF attention) or LlamaForCausalLM (standard attention) where those compute "
        "the model exactly; every other model (DIFF V2, symmetric DIFF, gated attention, GDA, MTA, XSA, PolyNorm "
        "MLPs, biases, a constant or shifted lambda_init, a Transformer converted to DIFF, ...) as remote code: "
        "config.json with auto_map and configuration_diff_transformer.py / modeling_diff_transformer.py beside the "
        "weights (torch and transformers only; load with trust_remote_code=True after reading them). Beside "
        "config.json: model.safetensors (fp32) and, when the checkpoint has one, the tokenizer as a "
        "PreTrainedTokenizerFast. --layout motif (the default for a model of Motif's arithmetic, such as one "
        "imported from Motif) writes Motif's released layout instead: its config.json fields and tensor names, "
        "sharded safetensors with an index, in the checkpoint's dtype. Needs the 'hf' extra.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", type=types.checkpoint_dir,
                        help="checkpoint directory of this project")
    export.add_argument("out", metavar="OUT", type=types.output_dir,
                        help="output directory: new or empty (an earlier export is replaced only with --overwrite)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it holds an earlier export of this project")
    export.add_argument("--layout", choices=["hf", "motif"], default=None,
                        help="hf: transformers (DiffLlama / Llama, else remote code); motif: Motif's released layout "
                        "(refused, writing nothing, for a model Motif's layout cannot express). Default: motif for a "
                        "model of Motif's arithmetic (PolyNorm MLP, Motif's lambda_init), else hf")
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
                     "names it, else <|endoftext|>); not with --no-tokenizer")
    imp.add_argument("--bos-token", default=None, metavar="TOKEN",
                     help="the tokenizer's begin token (default: as tokenizer_config.json or config.json in DIR names "
                     "it, else none); not with --no-tokenizer")
    imp.set_defaults(run=run_import)


def run_export(args: argparse.Namespace) -> int:
    from ..interop.hf import export_hf

    import json

    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite, layout=args.layout)
    model_type = json.loads((out / "config.json").read_text(encoding="utf-8")).get("model_type")
    if model_type == "Motif":
        print(f"wrote {out} (Motif's layout: what reads Motif's releases reads it)")
    elif model_type == "diff_transformer":
        print(f"wrote {out} (remote code: read {out / 'modeling_diff_transformer.py'}, then "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True))")
    else:
        print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..interop.hf import import_hf

    try:
        out = import_hf(args.directory, args.out, with_tokenizer=not args.no_tokenizer, overwrite=args.overwrite,
                        dtype=args.dtype, eos_token=args.eos_token, bos_token=args.bos_token)
    except KeyboardInterrupt as exc:  # a signal that came while the new checkpoint took its place: it is whole
        complete = getattr(exc, "output_complete", None)
        if complete is None or complete.path.resolve() != Path(args.out).resolve():
            raise
        out = complete.path
    print(f"wrote {out}")
    return 0
