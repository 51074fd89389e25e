"""scripts/train_step_ratio.py: every timed step is kept; the ratios (of the best steps, and the
median of per-round ratios) are checked against times given by a fake clock and worked out by hand."""

import importlib.util
from pathlib import Path

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_step_ratio.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_step_ratio", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # training steps of two models
def test_best_steps_and_ratios_follow_the_clock():
    script = load_script()
    contenders = {}
    for name, kind in (("DIFF (math)", "diff"), ("Transformer", "standard")):
        model = LanguageModel(ModelConfig.from_preset("debug", attention=kind),
                              attn_backend="math" if kind == "diff" else "auto")
        contenders[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    # the clock is read at each step's start and end, models taking turns in every round, after one
    # untimed warm-up round: DIFF steps take 3, 2, 4 s; Transformer steps 2.7, 1.9, 1 s
    clock = iter([10.0, 13.0, 20.0, 22.7, 30.0, 32.0, 40.0, 41.9, 50.0, 54.0, 60.0, 61.0]).__next__
    tokens = torch.randint(0, 512, (2, 8))
    seconds = script.step_seconds(contenders, tokens, rounds=3, warmup=1, clock=clock)
    assert seconds["DIFF (math)"] == [3.0, 2.0, 4.0]
    assert seconds["Transformer"] == pytest.approx([2.7, 1.9, 1.0], abs=1e-12)
    lines = script.report(seconds, tokens_per_step=1000)
    # best 2 s: 500 tokens/s; bests 1 / 2 = 0.5; per-round 0.9, 0.95, 0.25 -> median 0.9
    assert lines[0].split() == [
        "DIFF", "(math)", "2000.0", "ms", "500", "tokens/s", "vs", "Transformer:", "best", "0.500,", "per-round",
        "median", "0.900",
    ]
    assert lines[1].split()[-4:] == ["1.000,", "per-round", "median", "1.000"]
