"""Training: configs, the trainer (one CPU, one GPU, or torchrun), checkpoints and train state.

    from diff_transformer.train import load_config, train
    config = load_config("tiny", ["run.steps=50"])     # a shipped config name or a YAML path
    result = train(config, "diff")                      # one model of the config
    check_training(config, "diff")                      # what train checks first, writing nothing

The side-by-side comparison built on it is :mod:`diff_transformer.experiments`.
"""

from .config import ConfigError, TrainConfig, load_config, shipped_configs
from .trainer import TrainingError, TrainingPlan, TrainResult, check_training, train

__all__ = ["ConfigError", "TrainConfig", "TrainResult", "TrainingError", "TrainingPlan", "check_training",
           "load_config", "shipped_configs", "train"]
