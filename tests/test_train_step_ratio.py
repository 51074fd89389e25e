"""scripts/train_step_ratio.py: each model keeps its best step; the ratio is the Transformer's best
over the model's, checked against times given by a fake clock and a ratio worked out by hand."""

import importlib.util
from pathlib import Path

import torch

from diff_transformer import LanguageModel, ModelConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_step_ratio.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_step_ratio", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_best_steps_and_ratios_follow_the_clock():
    script = load_script()
    contenders = {}
    for name, kind in (("DIFF (math)", "diff"), ("Transformer", "standard")):
        model = LanguageModel(ModelConfig.from_preset("debug", attention=kind), attn_backend="math" if kind == "diff" else "auto")
        contenders[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    # the clock is read at each step's start and end, models taking turns in every round:
    # DIFF steps take 3, 2, 4 s; Transformer steps 1.5, 1, 1.25 s
    clock = iter([10.0, 13.0, 20.0, 21.5, 30.0, 32.0, 40.0, 41.0, 50.0, 54.0, 60.0, 61.25]).__next__
    tokens = torch.randint(0, 512, (2, 8))
    best = script.best_step_seconds(contenders, tokens, rounds=3, clock=clock)
    assert best == {"DIFF (math)": 2.0, "Transformer": 1.0}
    lines = script.report(best, tokens_per_step=1000)
    assert lines[0].split() == ["DIFF", "(math)", "2000.0", "ms", "500", "tokens/s", "vs", "Transformer", "0.500"]
    assert lines[1].split()[-1] == "1.000"
