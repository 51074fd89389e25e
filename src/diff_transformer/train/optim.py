"""AdamW (the paper's two recipes are in ``config.RECIPES``), and the warmup + linear-decay learning-rate schedule."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import OptimConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings (2-D and up); none on norm weights and λ vectors."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, through PyTorch's fused kernel (CPU and CUDA: one pass over
    every parameter instead of a few operator calls per tensor; ~7% of a small model's CPU step)."""
    return torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=device.type in ("cpu", "cuda"),
    )


def warmup_linear_lr(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of :class:`WarmupLinearSchedule`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return lr + (min_lr - lr) * progress


class WarmupLinearSchedule:
    """lr(step): linear warmup from lr/warmup to lr over ``warmup_steps``, then linear decay to
    ``min_lr`` at ``total_steps`` (held there after). ``step`` counts optimizer steps from 0.

    With ``total_seconds`` (a budget in seconds, :mod:`diff_transformer.train.budget`; then
    ``total_steps`` is None) the decay runs over seconds instead: the same formula with the
    training seconds spent (given after each step by :meth:`spend`) in the place of the step, from
    those spent when the warmup ended to ``total_seconds``."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int | None,
                 *, total_seconds: float | None = None) -> None:
        if (total_steps is None) == (total_seconds is None):
            raise ValueError("give the schedule's length in steps or in seconds, not both")
        self.optimizer = optimizer
        self.lr, self.min_lr = config.lr, config.min_lr
        self.warmup_steps = config.warmup_steps
        self.total_steps = total_steps
        self.total_seconds = total_seconds
        self.step_count = 0
        self.seconds = 0.0  # training seconds spent (a budget in seconds)
        self.warmup_end_seconds: float | None = 0.0 if self.warmup_steps == 0 else None
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.total_seconds is None:
            return warmup_linear_lr(step, self.lr, self.min_lr, self.warmup_steps, self.total_steps)
        if step < self.warmup_steps or self.warmup_end_seconds is None:
            return self.lr * min(step + 1, self.warmup_steps) / self.warmup_steps
        decay_seconds = max(self.total_seconds - self.warmup_end_seconds, 1e-9)
        progress = min(1.0, max(0.0, self.seconds - self.warmup_end_seconds) / decay_seconds)
        return self.lr + (self.min_lr - self.lr) * progress

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_count)

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.step_count)

    def step(self) -> None:
        """Advance after an optimizer step: the next step uses the next learning rate."""
        self.step_count += 1
        self._apply()

    def spend(self, seconds: float) -> None:
        """A budget in seconds: ``seconds`` of training spent so far (after a step); the next step's
        rate follows from it (the decay starts from the seconds spent when the warmup ended)."""
        self.seconds = seconds
        if self.warmup_end_seconds is None and self.step_count >= self.warmup_steps:
            self.warmup_end_seconds = seconds
        self._apply()

    def state_dict(self) -> dict[str, int | float | None]:
        return {"step_count": self.step_count, "seconds": self.seconds, "warmup_end_seconds": self.warmup_end_seconds}

    def load_state_dict(self, state: dict[str, int | float | None]) -> None:
        self.step_count = int(state["step_count"])
        self.seconds = float(state.get("seconds", 0.0))
        self.warmup_end_seconds = state.get("warmup_end_seconds", 0.0 if self.warmup_steps == 0 else None)
        self._apply()
