"""The model under test: a checkpoint loaded in eval mode with its tokenizer and a label, and the
attention kinds the reports compare (``BASELINE`` against ``DIFF_KINDS``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model import LanguageModel

BASELINE = "standard"  # the paper's "Transformer"
DIFF_KINDS = ("diff", "diff_v2", "diff_symmetric", "gda")


@dataclass
class ModelUnderTest:
    """A model, its tokenizer, and a short label for tables and plots."""

    label: str
    model: LanguageModel
    tokenizer: Any
    checkpoint: str | None = None

    @property
    def attention(self) -> str:
        return self.model.config.attention

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def describe(self) -> dict[str, Any]:
        with torch.no_grad():
            lambdas = self.model.lambdas()
        return {
            "checkpoint": self.checkpoint,
            "attention": self.attention,
            "parameters": self.model.num_parameters(),
            "max_seq_len": self.max_seq_len,
            "rope_theta": self.model.config.rope_theta,
            "lambdas": [round(x, 4) for x in lambdas],
        }


def load_with_context(
    checkpoint: str | Path,
    max_seq_len: int | None = None,
    rope_theta: float | None = None,
    *,
    device: str | torch.device = "cpu",
) -> LanguageModel:
    """A checkpoint's model (``save_pretrained`` layout) in eval mode, with its context set to
    ``max_seq_len`` and RoPE's base to ``rope_theta`` where given (None: the saved value).

    Neither is in the weights (the RoPE table is computed from them), so a short model can be read
    beyond its own context, e.g. before and after ``train --init-from`` extends it. A bad value is a
    ConfigError naming it."""
    from ..checkpoint import WEIGHTS_FILE, load_state_dict_checked, read_config, read_weights

    saved, _ = read_config(checkpoint)
    changes: dict[str, Any] = {}
    if max_seq_len is not None:
        changes["max_seq_len"] = max_seq_len
    if rope_theta is not None:
        changes["rope_theta"] = rope_theta
    config = dataclasses.replace(saved, **changes)  # ModelConfig checks the values
    model = LanguageModel(config, device="meta")
    model.to_empty(device=device)
    weights = Path(checkpoint) / WEIGHTS_FILE
    load_state_dict_checked(model, read_weights(weights), source=str(weights))
    return model.eval()


def load_model(
    checkpoint: str | Path,
    *,
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
    label: str | None = None,
    max_seq_len: int | None = None,
    rope_theta: float | None = None,
) -> ModelUnderTest:
    """A checkpoint directory (``save_pretrained``) in eval mode with its tokenizer.

    ``tokenizer`` (a tokenizer, or its name or path: "bytes", "default", a JSON file) is needed only
    if the checkpoint holds none, and must be the model's (:func:`~diff_transformer.checkpoint.tokenizer_for_model`).
    ``max_seq_len`` and ``rope_theta``, where given, replace the saved context and RoPE base
    (:func:`load_with_context`).
    """
    from ..checkpoint import tokenizer_for_model

    model = load_with_context(checkpoint, max_seq_len, rope_theta, device=device)
    tokenizer = tokenizer_for_model(checkpoint, model.config.vocab_size, tokenizer)
    if tokenizer is None:
        raise ValueError(f"{checkpoint} holds no tokenizer; pass one (--tokenizer)")
    directory = Path(checkpoint).resolve()
    if directory.name == "checkpoint":  # the trainer's layout: RUN_DIR/checkpoint
        directory = directory.parent
    name = label or f"{model.config.attention}:{directory.name}"
    return ModelUnderTest(label=name, model=model, tokenizer=tokenizer, checkpoint=str(checkpoint))
