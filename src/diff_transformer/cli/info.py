"""diff-transformer info: presets, or what a checkpoint holds."""

from __future__ import annotations

import argparse
import json

from .args import checkpoint_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "info",
        help="list model presets, or describe a checkpoint",
        description="Without an argument: the named presets with their DIFF, matched-Transformer, symmetric-DIFF, "
        "gated-attention (a gate per channel), head-wise gated, multi-token-attention (MTA) and grouped-differential "
        "(GDA: the DIFF heads as signal heads, r of them per noise head, r the largest of 4, 3, 2 dividing them) "
        "parameter counts (the wide-head Transformer, n_heads halved, and exclusive self-attention have the matched "
        "Transformer's; XSA with xsa_gate n_heads more per layer). With a checkpoint directory: its config, "
        "parameters, heads and λ per layer.",
    )
    p.add_argument("checkpoint", nargs="?", type=checkpoint_dir, help="checkpoint directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import PRESETS, ModelConfig
    from ..model import LanguageModel

    if args.checkpoint is None:
        from ..bench.model import default_gda_ratio

        kinds = ("diff", "standard", "diff_symmetric", "gated", "gated_headwise", "mta")
        print(f"{'preset':<8} {'d_model':>7} {'layers':>6} {'heads':>9} {'d':>4} {'DIFF params':>14} "
              f"{'Transformer':>14} {'Symmetric':>14} {'Gated':>14} {'Gated/head':>14} {'MTA':>14} {'GDA (r)':>18}")
        for name in PRESETS:
            diff, std, *others = (ModelConfig.from_preset(name, attention=kind) for kind in kinds)
            ratio = default_gda_ratio(diff.n_heads)
            gda = ModelConfig.from_preset(name, attention="gda", gda_ratio=ratio)
            counts = "".join(f" {LanguageModel(c, device='meta').num_parameters():>14,}" for c in (diff, std, *others))
            counts += f" {LanguageModel(gda, device='meta').num_parameters():>14,} ({ratio})"
            heads = f"{diff.n_heads}/{std.n_heads}"
            print(f"{name:<8} {diff.d_model:>7} {diff.n_layers:>6} {heads:>9} {diff.head_dim:>4}{counts}")
        return 0
    model = LanguageModel.from_pretrained(args.checkpoint)
    config = model.config
    print(json.dumps(config.to_dict(), indent=2))
    print(f"parameters: {model.num_parameters():,} "
          f"({model.num_parameters(exclude_embeddings=True):,} without embeddings)")
    if config.attention == "gda":
        print(f"heads: {config.n_heads} signal, {config.n_noise_heads} noise ({config.gda_ratio} signal per noise "
              f"head), {config.n_kv_heads} key/value groups, d = {config.head_dim}")
    if model.lambdas():
        print("lambda per layer: " + " ".join(f"{x:.3f}" for x in model.lambdas()))
    return 0
