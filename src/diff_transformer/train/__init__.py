"""Training: configs, the trainer (one CPU, one GPU, or torchrun), checkpoints, and ``compare``.

    from diff_transformer.train import load_config, train, compare
    config = load_config("tiny", ["run.steps=50"])     # a shipped config name or a YAML path
    result = train(config, "diff")                      # one model of the config
    compare(config, out_dir="out/compare")              # every model, same data, report.md
"""

from .compare import compare
from .config import ConfigError, TrainConfig, load_config, shipped_configs
from .trainer import TrainingError, TrainResult, train

__all__ = ["ConfigError", "TrainConfig", "TrainResult", "TrainingError", "compare", "load_config", "shipped_configs", "train"]
