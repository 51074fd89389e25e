"""A preallocated key/value cache for incremental decoding.

Buffers are allocated once for ``max_len`` tokens, so decoding never reallocates and the
tensors keep their addresses (what CUDA graphs and torch.compile want). Per layer:

    standard  k (B, Hkv, L, d)    v (B, Hkv, L, d)
    diff      k (B, 2Hkv, L, d)   v (B, Hkv, L, 2d)   K1/K2 interleaved as sub-heads 2g, 2g+1
    diff_v2   k (B, Hkv, L, d)    v (B, Hkv, L, d)
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from .config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        d, hkv = config.head_dim, config.n_kv_heads
        if config.attention == "diff":
            k_shape, v_shape = (batch_size, 2 * hkv, max_len, d), (batch_size, hkv, max_len, 2 * d)
        else:
            k_shape = v_shape = (batch_size, hkv, max_len, d)
        self.keys = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0  # tokens already stored; the next token goes to position `length`
        self.lambdas: dict[int, Tensor] = {}  # DIFF λ per layer, computed once while decoding

    def update(self, layer_index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, heads, T, w) at positions length .. length+T-1 and return all so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; writing {k.shape[2]} more at {self.length} overflows it")
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KV cache was made for batch size {self.batch_size}, got {k.shape[0]}")
        keys, values = self.keys[layer_index], self.values[layer_index]
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, n: int) -> None:
        """Called by the model once every layer has stored the n new tokens."""
        self.length += n

    def expand(self, repeats: int, max_len: int | None = None) -> "KVCache":
        """A new cache holding what this one holds with every row repeated ``repeats`` times (row i
        becomes rows i·repeats … i·repeats + repeats − 1), room for ``max_len`` tokens (default:
        this cache's). For evaluations that branch one prefix into several continuations."""
        max_len = self.max_len if max_len is None else max_len
        if repeats < 1 or max_len < self.length:
            raise ValueError(f"expand needs repeats >= 1 and max_len >= {self.length} cached tokens, got {repeats}, {max_len}")
        n = self.length
        new = copy.copy(self)  # every setting as here; buffers, rows, room and λ replaced below
        new.keys, new.values = [], []
        for stored, out in ((self.keys, new.keys), (self.values, new.values)):
            for buffer in stored:
                b, heads, _, width = buffer.shape
                branched = buffer.new_zeros(b * repeats, heads, max_len, width)
                branched[:, :, :n] = buffer[:, :, :n].repeat_interleave(repeats, dim=0)
                out.append(branched)
        new.batch_size, new.max_len = self.batch_size * repeats, max_len
        new.lambdas = dict(self.lambdas)
        return new

    def reset(self) -> None:
        self.length = 0
        self.lambdas.clear()
