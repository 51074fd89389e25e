"""DIFF Transformer: differential attention (Ye et al., ICLR 2025) and a matched Transformer.

    from diff_transformer import LanguageModel, ModelConfig
    config = ModelConfig.from_preset("tiny", attention="diff")
    model = LanguageModel(config)
    logits, loss = model(tokens, targets)

The names below are imported on first use (PEP 562), so that importing the package (what the
``diff-transformer`` command does first) is instant and torch loads inside the command, where an
interrupt is answered with one line rather than a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention import AttentionTap, DiffAttention, DiffV2Attention, StandardAttention
    from .cache import KVCache, StaticKVCache
    from .config import PRESETS, ConfigError, ModelConfig
    from .model import LanguageModel
    from .multihead import MultiheadDiffAttention
    from .ops import diff_attention

# Each public name and the module that defines it.
_EXPORTS = {
    "PRESETS": "config", "ConfigError": "config", "ModelConfig": "config",
    "AttentionTap": "attention", "DiffAttention": "attention", "DiffV2Attention": "attention",
    "StandardAttention": "attention", "KVCache": "cache", "StaticKVCache": "cache", "LanguageModel": "model",
    "MultiheadDiffAttention": "multihead", "diff_attention": "ops",
}

__all__ = [
    "PRESETS",
    "AttentionTap",
    "ConfigError",
    "DiffAttention",
    "DiffV2Attention",
    "KVCache",
    "LanguageModel",
    "ModelConfig",
    "MultiheadDiffAttention",
    "StandardAttention",
    "StaticKVCache",
    "diff_attention",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
