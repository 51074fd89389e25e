"""DIFF / Transformer training-step throughput, the models taking turns step by step.

    python scripts/train_step_ratio.py                          # tiny, batch 8, 256 tokens, 12 rounds
    python scripts/train_step_ratio.py --backends math sdpa_split --rounds 20

`diff-transformer bench model` times each model's repeats as a block, so a change in the
machine's load between blocks moves its ratio by several points. Here every round runs one
training step (forward, backward, AdamW) of each model in turn, and each model keeps its best
step: the ratio of two bests measured under the same conditions. DIFF runs once per backend
given; the Transformer runs on "auto" (PyTorch SDPA).
"""

from __future__ import annotations

import argparse
import time

import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.ops import BACKEND_NAMES


def best_step_seconds(contenders: dict, tokens: torch.Tensor, rounds: int, clock=time.perf_counter) -> dict[str, float]:
    """Each round runs one training step of every (model, optimizer) in turn; each keeps its best."""
    best = {name: float("inf") for name in contenders}
    for _ in range(rounds):
        for name, (model, optimizer) in contenders.items():
            start = clock()
            _, loss = model(tokens, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            best[name] = min(best[name], clock() - start)
    return best


def report(best: dict[str, float], tokens_per_step: int) -> list[str]:
    """One line per model: best step, tokens/s, and the Transformer's best step over its own."""
    return [
        f"{name:20s} {seconds * 1e3:8.1f} ms  {tokens_per_step / seconds:9.0f} tokens/s  "
        f"vs Transformer {best['Transformer'] / seconds:.3f}"
        for name, seconds in best.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=12, help="steps per model; the best is kept")
    p.add_argument("--backends", nargs="+", default=["auto"], choices=BACKEND_NAMES, help="DIFF's backends")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    contenders = {}
    for name, kind, backend in [*((f"DIFF ({b})", "diff", b) for b in args.backends), ("Transformer", "standard", "auto")]:
        torch.manual_seed(0)
        config = ModelConfig.from_preset(args.preset, attention=kind, max_seq_len=max(args.length, 16))
        model = LanguageModel(config, attn_backend=backend)
        contenders[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    vocab = next(iter(contenders.values()))[0].config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.length))

    best = best_step_seconds(contenders, tokens, args.rounds)
    print(f"{args.preset}, batch {args.batch}, {args.length} tokens, {torch.get_num_threads()} threads, best of {args.rounds} steps")
    print("\n".join(report(best, args.batch * args.length)))


if __name__ == "__main__":
    main()
