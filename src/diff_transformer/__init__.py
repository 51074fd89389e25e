"""DIFF Transformer: differential attention (Ye et al., ICLR 2025) and a matched Transformer.

    from diff_transformer import LanguageModel, ModelConfig
    config = ModelConfig.from_preset("tiny", attention="diff")
    model = LanguageModel(config)
    logits, loss = model(tokens, targets)
"""

from .attention import AttentionTap, DiffAttention, DiffV2Attention, StandardAttention
from .cache import KVCache, StaticKVCache
from .config import PRESETS, ConfigError, ModelConfig
from .model import LanguageModel
from .multihead import MultiheadDiffAttention
from .ops import diff_attention

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
