"""The decoder-only language model, LLaMA-style, for every attention kind.

    x = embed(tokens)                      (B, T, E)
    for each layer:
        x = x + Attention(RMSNorm(x))       standard | diff | diff_v2 | diff_symmetric | gated(_headwise) | gda
                                            | mta | xsa
        x = x + GatedMLP(RMSNorm(x))        (act(x W_gate) * x W_up) W_down, act SiLU (SwiGLU) or PolyNorm
    logits = lm_head(RMSNorm(x))           (B, T, V)

No biases unless the config asks for them (``attention_bias``, ``attention_out_bias``, ``mlp_bias``:
imported models). The model is built on the meta device and then given memory and values by one
explicit function, :meth:`LanguageModel.init_weights`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import checkpoint
from .attention import ATTENTION_CLASSES, AttentionTap, RMSNorm, rms_norm, rope_frequencies
from .cache import KVCache, StaticKVCache
from .config import PRESETS, ModelConfig
from .loss import IGNORE_INDEX, linear_cross_entropy
from .ops import BACKEND_NAMES, document_block_mask, key_padding_to_attn_mask

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


# At most this many rows (tokens) of the LM head are computed as (W·xᵀ)ᵀ on CPU: for a few rows
# against a large vocabulary that runs 1.4-4x faster than x·Wᵀ at 4 to 64 rows (measured on this
# project's 2-core machine, 8,192 words, E = 192 and 512; BENCHMARKS.md).
FEW_HEAD_ROWS = 64


def _head_logits(x: Tensor, weight: Tensor) -> Tensor:
    """x (B, T, E) @ weightᵀ -> logits (B, T, V), contiguous."""
    rows = x.shape[0] * x.shape[1]
    if x.device.type == "cpu" and 1 < rows <= FEW_HEAD_ROWS and not torch.compiler.is_compiling():
        return (weight @ x.reshape(rows, -1).t()).t().contiguous().view(*x.shape[:-1], -1)
    return F.linear(x, weight)


def _check_device(name: str, tensor: Tensor, device: torch.device, whose: str = "the tokens'") -> None:
    """A ValueError naming ``name`` unless ``tensor`` lies on ``device`` (torch's own error comes from
    deep inside the forward and names neither)."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, {whose} device is {device}: move it there "
                         f"({name}.to({str(device)!r}))")


def document_ids(tokens: Tensor, separator_id: int) -> Tensor:
    """tokens (B, T) -> (B, T) int64: which document each token belongs to, for documents packed
    into one sequence (``data.packing: documents``). A document starts at each ``separator_id``
    token: the end-of-text token that ends one document opens the next, as a beginning-of-sequence
    token would, so that every target is predicted from its own document alone."""
    return (tokens == separator_id).long().cumsum(dim=1)


def _document_starts(document_ids: Tensor) -> Tensor:
    """(B, T) bool: True where a document (a run of equal ids) starts."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """(B, T) ids -> (B, T) int64: each token's position counted from its document's first token."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.where(_document_starts(document_ids), index, 0).cummax(dim=1).values  # its document's first
    return index - first


def document_attention_mask(document_ids: Tensor) -> Tensor:
    """(B, T) ids -> (B, 1, T, T) bool: True where query and key lie in the same document (a run of
    equal ids); with the causal mask the ops add, the block-diagonal causal mask."""
    runs = _document_starts(document_ids).long().cumsum(dim=1)
    return (runs[:, :, None] == runs[:, None, :]).unsqueeze(1)


class PolyNorm(nn.Module):
    """Motif's MLP activation, PolyNorm (Zhuo et al. 2024, arXiv 2411.03884), as Motif's published
    code computes it (vLLM's and the MLX port's ``PolyNorm``): in fp32, over the last dim,

        w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b,     norm(z) = z / sqrt(mean(z²) + eps)

    weight (3,) initialised 1/3 each, bias (1,) 0 (their init)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(3))
        self.bias = nn.Parameter(torch.empty(1))

    def forward(self, x: Tensor) -> Tensor:
        z = x.float()
        w = self.weight.float()
        out = (w[0] * rms_norm(z * z * z, None, self.eps) + w[1] * rms_norm(z * z, None, self.eps)
               + w[2] * rms_norm(z, None, self.eps) + self.bias.float())
        return out.type_as(x)


class GatedMLP(nn.Module):
    """down(act(x W_gate) ⊙ x W_up): SwiGLU with act = SiLU (the paper's), or act = PolyNorm
    (``ffn_activation="polynorm"``: Motif's MLP, PolyNorm in SiLU's place, vLLM's ``MotifMLP``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, hidden, bias = config.d_model, config.ffn_hidden, config.mlp_bias
        self.gate_proj = nn.Linear(e, hidden, bias=bias)
        self.up_proj = nn.Linear(e, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, e, bias=bias)
        self.polynorm = PolyNorm(config.polynorm_eps) if config.ffn_activation == "polynorm" else None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """gate/up at N(0, std); down_proj (it writes into the residual stream) at N(0, out_std); biases 0;
        PolyNorm's weights 1/3 and bias 0."""
        self.gate_proj.weight.normal_(0.0, std, generator=generator)
        self.up_proj.weight.normal_(0.0, std, generator=generator)
        self.down_proj.weight.normal_(0.0, out_std, generator=generator)
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            if proj.bias is not None:
                proj.bias.zero_()
        if self.polynorm is not None:
            self.polynorm.weight.fill_(1 / 3)
            self.polynorm.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.polynorm is None else self.polynorm(gate)
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = ATTENTION_CLASSES[config.attention](config, layer_index)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = GatedMLP(config)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        self.attn_norm.weight.fill_(1.0)
        self.attn.init_weights(std, out_std, generator)
        self.ffn_norm.weight.fill_(1.0)
        self.ffn.init_weights(std, out_std, generator)

    def forward(
        self,
        x: Tensor,
        rope: Tensor,
        cache: KVCache | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache=cache, attn_mask=attn_mask, positions=positions)
        return x + self.ffn(self.ffn_norm(x))


class LanguageModel(nn.Module):
    """``LanguageModel(config)``; ``logits, loss = model(tokens, targets)``.

    ``device="meta"`` leaves the parameters unallocated (for FSDP: shard, then
    ``to_empty`` and :meth:`init_weights`); any other device allocates and initialises. Without
    ``device``, the ambient default device is used (``with torch.device("meta"): ...`` works).
    ``attn_backend`` is the runtime attention backend (see diff_transformer.ops and
    :meth:`set_attention_backend`); it is not part of the config or the checkpoint. "auto" never
    runs the fused Triton kernel: ``attn_backend="triton"`` opts in (verified in Triton's
    interpreter and compiled for sm_90, not yet measured on a GPU; ``diff-transformer bench gpu``
    checks and times it on yours).
    """

    def __init__(
        self, config: ModelConfig, *, device: torch.device | str | None = None, attn_backend: str = "auto"
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            hint = "ModelConfig(...) or ModelConfig.from_preset(...)"
            if isinstance(config, str) and config in PRESETS:
                hint = f"ModelConfig.from_preset({config!r})"
            elif isinstance(config, dict):
                hint = "ModelConfig.from_dict(...)"
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__} {config!r}; pass {hint}")
        self.config = config
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):  # built unallocated, then allocated once on the target device
            # its weight passed in: nn.Embedding's own init on "meta" would import torch._dynamo (2.4 s)
            self.embed = nn.Embedding(config.vocab_size, config.d_model,
                                      _weight=torch.empty(config.vocab_size, config.d_model))
            self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._rope_tables: dict[torch.device, Tensor] = {}  # see _rope_table
        self.set_attention_backend(attn_backend)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Give every tensor its initial value (seed the global RNG or pass ``generator``); each
        module initialises its own tensors, in this order: embed, then per layer the attention
        and the FFN, then lm_head.

        - embed.weight, lm_head.weight, every q/k/v/qk/gate/up projection (the gated kinds' attention
          gate_proj too), DIFF V2's lambda_proj: N(0, init_std)
        - o_proj and down_proj (they write into the residual stream): N(0, init_std / sqrt(2 L)), or
          N(0, init_std) with ``scale_residual_init=False``
        - DIFF lambda_q1, lambda_k1, lambda_q2, lambda_k2: N(0, lambda_std) in fp32
        - every RMSNorm weight (block norms, final norm, head norms): 1
        - biases, where the config has them: 0; PolyNorm's weights 1/3, its bias 0
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers) if self.config.scale_residual_init else std
        self.embed.weight.normal_(0.0, std, generator=generator)
        for layer in self.layers:
            layer.init_weights(std, out_std, generator)
        self.norm.weight.fill_(1.0)
        if self.lm_head is not None:
            self.lm_head.weight.normal_(0.0, std, generator=generator)

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        padding_mask: Tensor | None = None,
        return_logits: bool = True,
        reduction: str = "mean",
        logits_to_keep: int = 0,
        check_ids: bool = True,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """tokens (B, T) int -> logits (B, T, V) and the cross-entropy against targets (B, T).

        Targets equal to -100 are ignored; ``reduction`` "mean" (over counted targets: at least one
        must count), "sum", or "none" (a loss per target, 0 where ignored; with the logits only).
        ``return_logits=False`` (with targets) returns (None, loss) and computes the loss without
        ever holding the (B, T, V) logits (:func:`~diff_transformer.loss.linear_cross_entropy`;
        its gradients are taken in the forward): what training wants.

        With ``cache``, the tokens continue what the cache holds. ``padding_mask`` (B, S) bool marks
        real tokens among all S = cached + T positions (False = padding, never attended to; a padded
        query attends to itself only); with a :class:`~diff_transformer.cache.StaticKVCache` it
        covers the new T tokens only.

        ``document_ids`` (B, T) integers pack several documents into each sequence (a document is a
        run of equal ids, :func:`document_ids` makes them from the end-of-text tokens): attention
        stays within each document (the causal mask made block-diagonal) and RoPE positions
        restart at 0 at each document's first token, so that every document's outputs are those
        it has alone. Not with a cache or a padding mask. With the "flex" backend the mask is a
        FlexAttention block mask, built once per call; otherwise a (B, 1, T, T) bool mask.

        ``logits_to_keep`` N > 0 computes the logits of the last N positions only, (B, N, V), as
        transformers' argument of that name: a prompt's prefill wants one row, not T rows against
        the whole vocabulary. 0 keeps all; it must be 0 with targets.

        Every id must lie in [0, vocab_size) (a target may also be -100). The ids are checked (one
        pass and one read back, a device sync on GPU) unless ``check_ids=False`` (decoding steps
        feed back ids the model sampled itself) or the call is being compiled (torch.compile),
        where the check would break the graph; the shapes and dtypes are always checked.
        """
        per_target_without_logits = reduction == "none" and targets is not None and not return_logits
        if reduction not in ("mean", "sum", "none") or per_target_without_logits:
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none' (the last with return_logits=True), got "
                             f"{reduction!r}" + (" with return_logits=False" if per_target_without_logits else ""))
        self._check_inputs(tokens, targets, check_ids and not torch.compiler.is_compiling(), reduction)
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0 or (logits_to_keep and targets is not None):
            raise ValueError(f"logits_to_keep must be an integer >= 0, and 0 with targets; got {logits_to_keep!r}")
        if cache is not None and cache.keys[0].dtype != self.embed.weight.dtype:
            raise TypeError(f"cache holds {cache.keys[0].dtype} keys and values, the model computes in "
                            f"{self.embed.weight.dtype}: make the cache after converting the model (model.new_cache)")
        b, t = tokens.shape
        table = self._rope_table(tokens.device)
        if document_ids is not None:
            self._check_document_ids(document_ids, tokens, cache, padding_mask)
            positions = None
            rope = table[positions_in_documents(document_ids)]  # (B, T, d/2, 2): each document from 0
            flex = self.attn_backend == "flex" and all(layer.attn.tap is None and layer.attn.takes_block_mask
                                                       for layer in self.layers)
            attn_mask = document_block_mask(document_ids) if flex else document_attention_mask(document_ids)
        elif cache is not None and cache.static:  # positions stay on the device: one graph for every step
            positions = cache.positions(t)
            rope = table.index_select(0, positions)
            attn_mask = cache.attn_mask(positions, padding_mask)
        else:
            start = 0 if cache is None else cache.length
            if start + t > self.config.max_seq_len:
                raise ValueError(f"sequence of {start + t} tokens exceeds max_seq_len={self.config.max_seq_len}")
            positions = None if cache is None else cache.positions(t)
            rope = table[start : start + t]  # (T, d/2, 2) cos, sin
            attn_mask = None
            if padding_mask is not None:  # (B, S) -> (B, 1, T, S), once for every layer, by the ops' rule
                s = start + t
                if padding_mask.shape[-1] != s or padding_mask.dtype != torch.bool:
                    got = f"{padding_mask.dtype} {tuple(padding_mask.shape)}"
                    raise ValueError(f"padding_mask must be bool (batch, {s}), got {got}")
                _check_device("padding_mask", padding_mask, tokens.device)
                attn_mask = key_padding_to_attn_mask(padding_mask, t, s)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, rope, cache, attn_mask, positions)
        if cache is not None:
            cache.advance(t)
        x = self.norm(x)
        # (V, E), read as a weight by the fused loss and the few-row product: lm_head's hooks do not run
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if targets is not None and not return_logits and not torch.compiler.is_compiling():
            return None, linear_cross_entropy(x.flatten(0, 1), head, targets.flatten(), reduction=reduction)
        logits = _head_logits(x[:, -logits_to_keep:] if logits_to_keep else x, head)
        loss = None
        if targets is not None:
            flat = logits.float().flatten(0, 1)
            loss = F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
        return (logits if return_logits else None), loss

    def _check_inputs(self, tokens: Tensor, targets: Tensor | None, check_ids: bool, reduction: str = "mean") -> None:
        """A TypeError / ValueError naming the argument and the value if ``tokens`` is not a
        non-empty (B, T) integer tensor of ids in [0, vocab_size), or ``targets`` not one of the
        same shape holding such ids or -100, with at least one counted for a mean (the ids and the
        count only with ``check_ids``)."""
        for name, ids in (("tokens", tokens), ("targets", targets)):
            if ids is None:
                continue
            if not isinstance(ids, Tensor):
                raise TypeError(f"{name} must be a (batch, length) tensor of token ids, got {type(ids).__name__}")
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"{name} must hold integer token ids (torch.long), got dtype {ids.dtype}")
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"tokens must be (batch, length) with at least one token, got shape {tuple(tokens.shape)}")
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, got {tuple(targets.shape)}")
        _check_device("tokens", tokens, self.embed.weight.device, "the model's")
        if targets is not None:
            _check_device("targets", targets, tokens.device)
        if not check_ids:
            return
        vocab = self.config.vocab_size
        bounds = [*torch.aminmax(tokens)]
        if targets is not None:  # ignored targets (-100) count as 0
            ignored = targets == IGNORE_INDEX
            bounds += [*torch.aminmax(targets.masked_fill(ignored, 0)), ignored.all()]
        low, high, *target_bounds = torch.stack([b.long() for b in bounds]).tolist()  # one read back
        if low < 0 or high >= vocab:
            raise ValueError(f"tokens: id {low if low < 0 else high} is out of range [0, vocab_size={vocab})")
        if target_bounds and target_bounds[2] and reduction == "mean":
            raise ValueError(f"targets: every target is {IGNORE_INDEX} (ignored), so the mean loss over them is 0/0 "
                             f"(NaN); give at least one target to count, or reduction='sum' (0)")
        if target_bounds and (target_bounds[0] < 0 or target_bounds[1] >= vocab):
            bad = target_bounds[0] if target_bounds[0] < 0 else target_bounds[1]
            raise ValueError(f"targets: id {bad} is out of range [0, vocab_size={vocab}) and is not {IGNORE_INDEX} "
                             "(ignored)")

    def _check_document_ids(self, document_ids: Tensor, tokens: Tensor, cache: KVCache | None,
                            padding_mask: Tensor | None) -> None:
        if cache is not None or padding_mask is not None:
            raise ValueError("document_ids pack documents into the sequences of one forward (training, scoring); "
                             "not with a cache or a padding_mask")
        if not isinstance(document_ids, Tensor) or document_ids.shape != tokens.shape or (
                document_ids.dtype.is_floating_point or document_ids.dtype.is_complex):
            got = f"{document_ids.dtype} {tuple(document_ids.shape)}" if isinstance(document_ids, Tensor) else (
                type(document_ids).__name__)
            raise ValueError(f"document_ids must be integers of the tokens' shape {tuple(tokens.shape)}, got {got}")
        _check_device("document_ids", document_ids, tokens.device)
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len={self.config.max_seq_len}")

    def _rope_table(self, device: torch.device) -> Tensor:
        """cos, sin of every position < max_seq_len, fp32 (L, d/2, 2): computed once per device and
        kept off the state dict and out of ``.to(dtype)``, so that a step only slices it."""
        table = self._rope_tables.get(device)
        if table is None:
            positions = torch.arange(self.config.max_seq_len, device=device)
            table = self._rope_tables[device] = rope_frequencies(positions, self.config.head_dim,
                                                                 self.config.rope_theta, self.config.rope_scaling)
        return table

    # --- introspection -------------------------------------------------------------------

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count; with ``exclude_embeddings`` the token embedding and LM head are left out."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.weight.numel() + (0 if self.lm_head is None else self.lm_head.weight.numel())
        return total

    def lambdas(self) -> list[float]:
        """The learned scalar λ of every layer that has one (DIFF; empty for other kinds)."""
        with torch.no_grad():
            values = [layer.attn.lam() for layer in self.layers]
        return [v.item() for v in values if v is not None]

    @contextmanager
    def tap_attention(self, tap: AttentionTap) -> Iterator[AttentionTap]:
        """Within the block, every attention layer reports to ``tap`` (reference backend)."""
        for layer in self.layers:
            layer.attn.tap = tap
        try:
            yield tap
        finally:
            for layer in self.layers:
                layer.attn.tap = None

    @property
    def attn_backend(self) -> str:
        """The attention backend every layer dispatches with (a runtime setting, not saved)."""
        return self.layers[0].attn.backend

    def set_attention_backend(self, backend: str) -> None:
        """Switch the attention backend of every layer (see diff_transformer.ops)."""
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        for layer in self.layers:
            layer.attn.backend = backend

    # --- inference and checkpoints ----------------------------------------------------------

    def new_cache(self, batch_size: int, max_len: int | None = None, *, static: bool = False) -> KVCache:
        """An empty KV cache on this model's device, in its dtype; ``static=True`` gives a
        :class:`~diff_transformer.cache.StaticKVCache` (for compiled decoding)."""
        p = self.embed.weight
        kind = StaticKVCache if static else KVCache
        return kind(self.config, batch_size, max_len or self.config.max_seq_len, device=p.device, dtype=p.dtype)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, **sampling) -> list[list[int]]:
        """See :func:`diff_transformer.generation.generate`."""
        from .generation import generate

        return generate(self, prompts, max_new_tokens, **sampling)

    def save_pretrained(self, directory: str | Path, tokenizer: "Tokenizer | str | Path | None" = None, *,
                        overwrite: bool = False, reading: "Iterable[str | Path]" = ()) -> Path:
        """Write DIR/config.json, DIR/model.safetensors and the tokenizer (a tokenizer, or its name or
        path: "bytes", "default", a tokenizers JSON file), atomically. DIR must be
        new or empty; an earlier checkpoint of this project is replaced only with ``overwrite``;
        anything else (a file, a directory of other files, the current directory, a path among
        ``reading``) is an :class:`~diff_transformer.files.OutputPathError`."""
        return checkpoint.save_pretrained(self, directory, tokenizer=tokenizer, overwrite=overwrite, reading=reading)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, device: torch.device | str = "cpu", attn_backend: str = "auto"
    ) -> "LanguageModel":
        """Load a directory written by :meth:`save_pretrained` (on ``device``); every problem with
        its files is a CheckpointError naming the file."""
        config, _ = checkpoint.read_config(directory)
        model = cls(config, device="meta", attn_backend=attn_backend)
        model.to_empty(device=device)
        weights = Path(directory) / checkpoint.WEIGHTS_FILE
        checkpoint.load_state_dict_checked(model, checkpoint.read_weights(weights), source=str(weights))
        return model
