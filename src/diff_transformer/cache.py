"""Preallocated key/value caches for incremental decoding.

Buffers are allocated once for ``max_len`` tokens, so decoding never reallocates and the
tensors keep their addresses. Per layer:

    standard  k (B, Hkv, L, d)    v (B, Hkv, L, d)
    diff      k (B, 2Hkv, L, d)   v (B, Hkv, L, 2d)   K1/K2 interleaved as sub-heads 2g, 2g+1
              (v (B, Hkv, L, d) with value_factor = 1)
              (diff_symmetric alike, its keys being its rotated queries)
    diff_v2   k (B, Hkv, L, d)    v (B, Hkv, L, d)    (gated, gated_headwise alike: the gate is computed from x;
                                                        xsa alike: the own value is the stored v)
    mta       k (B, Hkv, L, d)    v (B, Hkv, L, d)    and, on the layers with the key-query convolution,
              q (B, H, L, d)      the rotated queries: a new query's map is convolved with the maps of
                                  the 2(c_q − 1) queries before it (``MultiTokenAttention``)

Two kinds, one interface (``positions``, ``update``, ``update_queries``, ``advance``, ``expand``, ``reset``):

- :class:`KVCache` keeps its length as a Python int and attends over the filled prefix only:
  the least work per step, what eager decoding and the evaluations use.
- :class:`StaticKVCache` keeps the next position as a tensor on the device and attends over the
  whole buffer with a validity mask, so every decoding step has the same shapes and no Python
  number changes between steps: ``torch.compile`` builds one graph for all of them (no
  ``dynamic=True``), and on CUDA ``mode="reduce-overhead"`` can replay it as a CUDA graph.
"""

from __future__ import annotations

import copy
import numbers

import torch
from torch import Tensor

from .config import DIFF_HEAD_KINDS, ModelConfig


class KVCache:
    """Per-layer key/value buffers filled left to right; ``length`` (a Python int) tokens so far.
    Made by ``LanguageModel.new_cache``; the model calls ``positions``, ``update`` and ``advance``."""

    static = False  # see StaticKVCache

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self._allocate(config, batch_size, max_len, device, dtype)
        self.length = 0  # tokens already stored; the next token goes to position `length`

    def _allocate(
        self, config: ModelConfig, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} of a KV cache must be a positive integer, got {value!r}")
        batch_size, max_len = int(batch_size), int(max_len)  # NumPy integers (a tokenizer's counts) as Python's
        if max_len > config.max_seq_len:  # positions beyond it have no RoPE angle: never reachable
            raise ValueError(f"a KV cache of {max_len} tokens exceeds max_seq_len={config.max_seq_len}")
        d, hkv = config.head_dim, config.n_kv_heads
        if config.attention in DIFF_HEAD_KINDS:
            k_shape, v_shape = (batch_size, 2 * hkv, max_len, d), (batch_size, hkv, max_len, config.value_factor * d)
        else:
            k_shape = v_shape = (batch_size, hkv, max_len, d)
        self.keys = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        # MTA's layers that convolve over earlier queries keep them (MultiTokenAttention)
        keeps_queries = [config.mta_conv_layer(i) and config.mta_query_kernel > 1 for i in range(config.n_layers)]
        q_shape = (batch_size, config.n_heads, max_len, d)
        self.queries = [torch.zeros(q_shape, device=device, dtype=dtype) if keep else None for keep in keeps_queries]
        self.batch_size = batch_size
        self.max_len = max_len
        self.max_seq_len = config.max_seq_len  # the model's limit (its RoPE table)
        # Per (layer, name): what a layer computes from its weights alone (DIFF's λ, its scaled head-norm
        # weight), computed once while decoding without gradients (Attention._fixed).
        self.constants: dict[tuple[int, str], Tensor] = {}

    def positions(self, t: int) -> Tensor:
        """(T,) long: the positions the next t tokens take; raises if they do not fit."""
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; writing {t} more at {self.length} overflows it")
        return torch.arange(self.length, self.length + t, device=self.keys[0].device)

    def _check_batch(self, k: Tensor) -> None:
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KV cache was made for batch size {self.batch_size}, got {k.shape[0]}")

    def update(self, layer_index: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, heads, T, w) at ``positions`` (from :meth:`positions`) and return every
        stored key and value, (B, heads, S, w) with S = length + T."""
        self._check_batch(k)
        keys, values = self.keys[layer_index], self.values[layer_index]
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        end = self.length + k.shape[2]
        return keys[:, :, :end], values[:, :, :end]

    def update_queries(self, layer_index: int, q: Tensor, positions: Tensor) -> Tensor:
        """Store the rotated queries q (B, H, T, d) at ``positions`` (a layer of MTA with the key-query
        convolution) and return every stored query, (B, H, S, d) as :meth:`update` returns keys."""
        queries = self.queries[layer_index]
        queries.index_copy_(2, positions, q)
        return queries[:, :, : self.length + q.shape[2]]

    def advance(self, n: int) -> None:
        """Called by the model once every layer has stored the n new tokens."""
        self.length += n

    def expand(self, repeats: int, max_len: int | None = None) -> "KVCache":
        """A new cache holding what this one holds with every row repeated ``repeats`` times (row i
        becomes rows i·repeats … i·repeats + repeats − 1), room for ``max_len`` tokens (default:
        this cache's). For evaluations that branch one prefix into several continuations."""
        max_len = self.max_len if max_len is None else max_len
        n = self.length
        if repeats < 1 or max_len < n:
            raise ValueError(f"expand needs repeats >= 1 and max_len >= {n} cached tokens, got {repeats}, {max_len}")
        new = copy.copy(self)  # every setting as here; buffers, rows, room and constants replaced below
        new.keys, new.values, new.queries = [], [], []
        for stored, out in ((self.keys, new.keys), (self.values, new.values), (self.queries, new.queries)):
            for buffer in stored:
                if buffer is None:  # a layer that keeps no queries
                    out.append(None)
                    continue
                b, heads, _, width = buffer.shape
                branched = buffer.new_zeros(b * repeats, heads, max_len, width)
                branched[:, :, :n] = buffer[:, :, :n].repeat_interleave(repeats, dim=0)
                out.append(branched)
        new.batch_size, new.max_len = self.batch_size * repeats, max_len
        new.constants = dict(self.constants)
        return new

    def reset(self) -> None:
        self.length = 0
        self.constants.clear()


class StaticKVCache(KVCache):
    """A cache whose decoding steps all have the same shapes (for torch.compile and CUDA graphs).

    The next position is a 0-d long tensor (``position``) advanced in place; every step attends
    over all ``max_len`` slots, the model hiding the slots after each query's position and the
    padding with a (B, 1, T, L) mask from :meth:`attn_mask`. The cache keeps the padding flags
    of what it holds, so ``padding_mask`` given to the model covers the new tokens only, (B, T)
    (at the first call, when the cache is empty, that is the whole (B, S) as for :class:`KVCache`);
    None means the new tokens are real. Costs over :class:`KVCache`: each step reads the whole
    buffer, and ``length`` reads the position back from the device.
    """

    static = True

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(f"a static KV cache of {max_len} tokens exceeds max_seq_len={config.max_seq_len}")
        self._allocate(config, batch_size, max_len, device, dtype)
        device = self.keys[0].device
        self.position = torch.zeros((), dtype=torch.long, device=device)  # where the next token goes
        self.real = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)  # False = padding
        self.padded = False  # whether any stored token is padding (else the mask skips the flags)
        self.slots = torch.arange(max_len, device=device)  # (L,) the position of every slot
        self._mark_static()

    def _mark_static(self) -> None:
        """Tell torch.compile that these tensors keep their addresses (CUDA graphs then need no copies)."""
        kept_queries = [q for q in self.queries if q is not None]
        for tensor in (*self.keys, *self.values, *kept_queries, self.position, self.real, self.slots):
            torch._dynamo.mark_static_address(tensor)

    @property
    def length(self) -> int:
        return int(self.position)

    def positions(self, t: int) -> Tensor:
        """(T,) long on the device: position + 0 … t − 1. Checked against max_len when eager only
        (the check reads the position back; a compiled step must not)."""
        if not torch.compiler.is_compiling() and (length := self.length) + t > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; writing {t} more at {length} overflows it")
        return self.position + self.slots[:t]

    def update(self, layer_index: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, heads, T, w) at ``positions``; return the whole buffers (B, heads, L, w)."""
        self._check_batch(k)
        keys, values = self.keys[layer_index], self.values[layer_index]
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        return keys, values

    def update_queries(self, layer_index: int, q: Tensor, positions: Tensor) -> Tensor:
        """Store q (B, H, T, d) at ``positions``; return the whole buffer (B, H, L, d)."""
        queries = self.queries[layer_index]
        queries.index_copy_(2, positions, q)
        return queries

    def attn_mask(self, positions: Tensor, padding_mask: Tensor | None) -> Tensor:
        """(B or 1, 1, T, L) bool: slot j is visible to the query at position p when j <= p and
        slot j holds a real token, or when j == p (a padded query keeps itself, staying finite).
        ``padding_mask`` (B, T) flags the new tokens and is stored."""
        t = positions.shape[0]
        if padding_mask is not None:
            if padding_mask.dtype != torch.bool or padding_mask.shape != (self.batch_size, t):
                raise ValueError(
                    "with a static KV cache, padding_mask flags the new tokens only: bool "
                    f"(batch, {t}) = {(self.batch_size, t)}, got {padding_mask.dtype} {tuple(padding_mask.shape)}"
                )
            self.real.index_copy_(1, positions, padding_mask)
            self.padded = True
        past = self.slots[None, :] <= positions[:, None]  # (T, L)
        if not self.padded:
            return past[None, None]
        own = self.slots[None, :] == positions[:, None]
        return (past[None] & self.real[:, None, :] | own[None])[:, None]

    def advance(self, n: int) -> None:
        self.position += n  # in place: the tensor keeps its address

    def expand(self, repeats: int, max_len: int | None = None) -> "StaticKVCache":
        if max_len is not None and max_len > self.max_seq_len:
            raise ValueError(f"a static KV cache of {max_len} tokens exceeds max_seq_len={self.max_seq_len}")
        new = super().expand(repeats, max_len)
        new.position = self.position.clone()
        kept = min(self.max_len, new.max_len)  # padding flags of the slots both caches have
        new.real = self.real.new_ones(new.batch_size, new.max_len)
        new.real[:, :kept] = self.real[:, :kept].repeat_interleave(repeats, dim=0)
        new.slots = torch.arange(new.max_len, device=self.slots.device)
        new._mark_static()
        return new

    def reset(self) -> None:
        self.position.zero_()
        self.real.fill_(True)
        self.padded = False
        self.constants.clear()
