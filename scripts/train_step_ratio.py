"""DIFF / Transformer training-step throughput, the models taking turns step by step.

    python scripts/train_step_ratio.py                          # tiny, batch 8, 256 tokens, 12 rounds
    python scripts/train_step_ratio.py --backends math sdpa_split --rounds 20

`diff-transformer bench model` times each model's repeats as a block, so a change in the
machine's load between blocks moves its ratio by several points. Here every round runs one
training step (forward, backward, AdamW) of each model in turn, after untimed warm-up rounds.
Two ratios against the Transformer: of the best steps, and the median over rounds of the
ratio within each round (steps run back to back, so a slow spell of the machine touches both
sides of a round's ratio). DIFF runs once per backend given; the Transformer runs on "auto"
(PyTorch SDPA).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.ops import BACKEND_NAMES


def train_step(model, optimizer, tokens: torch.Tensor) -> None:
    _, loss = model(tokens, tokens, return_logits=False)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_seconds(
    contenders: dict, tokens: torch.Tensor, rounds: int, warmup: int = 0, clock=time.perf_counter
) -> dict[str, list[float]]:
    """Each round runs one training step of every (model, optimizer) in turn: every timed step's seconds."""
    for _ in range(warmup):
        for model, optimizer in contenders.values():
            train_step(model, optimizer, tokens)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (model, optimizer) in contenders.items():
            start = clock()
            train_step(model, optimizer, tokens)
            seconds[name].append(clock() - start)
    return seconds


def report(seconds: dict[str, list[float]], tokens_per_step: int) -> list[str]:
    """One line per model: best step, its tokens/s, the Transformer's best over the model's best,
    and the median over rounds of the Transformer's step over the model's step."""
    baseline = seconds["Transformer"]
    lines = []
    for name, steps in seconds.items():
        best = min(steps)
        per_round = statistics.median(t / s for t, s in zip(baseline, steps))
        lines.append(
            f"{name:20s} {best * 1e3:8.1f} ms  {tokens_per_step / best:9.0f} tokens/s  "
            f"vs Transformer: best {min(baseline) / best:.3f}, per-round median {per_round:.3f}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=12, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--backends", nargs="+", default=["auto"], choices=BACKEND_NAMES, help="DIFF's backends")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    contenders = {}
    for name, kind, backend in [*((f"DIFF ({b})", "diff", b) for b in args.backends),
                                ("Transformer", "standard", "auto")]:
        torch.manual_seed(0)
        config = ModelConfig.from_preset(args.preset, attention=kind, max_seq_len=max(args.length, 16))
        model = LanguageModel(config, attn_backend=backend)
        contenders[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    vocab = next(iter(contenders.values()))[0].config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.length))

    seconds = step_seconds(contenders, tokens, args.rounds, args.warmup)
    print(
        f"{args.preset}, batch {args.batch}, {args.length} tokens, {torch.get_num_threads()} threads, "
        f"{args.rounds} timed rounds after {args.warmup} warm-up"
    )
    print("\n".join(report(seconds, args.batch * args.length)))


if __name__ == "__main__":
    main()
