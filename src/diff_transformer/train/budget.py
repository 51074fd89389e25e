"""How long a run trains: ``run.steps`` optimizer steps, or a budget (``run.budget``) in tokens,
training FLOPs (counted by :mod:`diff_transformer.flops`) or seconds of training steps.

    run: {budget: {kind: flops, amount: 2.0e+13}}     # each model until it has spent 2e13 training FLOPs

**Tokens and FLOPs** are a number of steps known before the run starts: the budget over one step's
tokens (data.batch_size × seq_len) or FLOPs (the model's at seq_len, times data.batch_size),
rounded down, so that a run spends at most its budget and less than one step below it.
:func:`resolve_steps` writes that count into run.steps, and from there the run is one of run.steps
steps like any other: the schedule decays over them, ``--resume`` is exact, a study reuses a
finished run. Each model gets its own count (a model of more FLOPs per token takes fewer steps).

**Seconds** count the training steps' own time (forward, backward, the optimizer step; not the
evaluations, diagnostics and checkpoints, nor each invocation's first step, which warms up: the
time ``TrainResult.train_seconds`` reports). The loop goes on while less than the budget has been
spent, so the last step ends less than one step's time past it. The number of steps is not known in
advance, so the schedule cannot be one over steps: the warmup is in steps (optim.warmup_steps) and
the linear decay to optim.min_lr runs over the seconds left after it (the step formula with seconds
in the place of steps: :class:`~diff_transformer.train.optim.WarmupLinearSchedule`), ending at the
budget whatever the machine's speed. Under torchrun every process takes rank 0's step times, so
all follow one schedule and stop at the same step. ``--resume`` goes on from the seconds the
checkpoint spent: honest (the decay is where the spent time puts it) but not a replay of a run
never stopped (the step times differ; each invocation's first step is free).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import MAX_STEPS
from ..config import ConfigError, ModelConfig
from ..flops import UnknownAttentionCost, training_flops
from .config import TrainConfig


MAX_SECONDS = 365 * 24 * 3600.0  # a budget in seconds beyond a year is a typo


@dataclass(frozen=True)
class RunLength:
    """A run's length as the loop reads it: a number of steps, or seconds of training steps."""

    kind: str  # "steps" (run.steps), or the budget's: "tokens", "flops", "seconds"
    steps: int | None  # the run's optimizer steps, known in advance; None for a budget in seconds
    seconds: float | None = None  # a budget in seconds

    @classmethod
    def of(cls, config: TrainConfig) -> "RunLength":
        """The length of a run whose config went through :func:`resolve_steps`."""
        budget = config.run.budget
        if budget is None:
            return cls("steps", config.run.steps)
        if budget.kind == "seconds":
            return cls("seconds", None, budget.amount)
        return cls(budget.kind, config.run.steps)

    def spent(self, step: int, train_seconds: float) -> bool:
        """Whether a run at optimizer step ``step`` (steps done), having trained ``train_seconds``, is done."""
        return train_seconds >= self.seconds if self.seconds is not None else step >= self.steps

    def describe(self) -> str:
        """"run.steps=56", "run.budget of 2e+13 flops (45 steps)", "run.budget of 90 seconds"."""
        if self.kind == "steps":
            return f"run.steps={self.steps}"
        if self.seconds is not None:
            return f"run.budget of {self.seconds:g} seconds"
        return f"run.budget of {self.kind} ({self.steps} steps)"


def flops_per_token(model_config: ModelConfig, seq_len: int) -> float | None:
    """Training FLOPs per token of the model at ``seq_len`` (:mod:`diff_transformer.flops`), or None
    for an attention kind the formula has no term for (its runs report no FLOPs)."""
    try:
        return training_flops(model_config, seq_len).per_token
    except UnknownAttentionCost:
        return None


def resolve_steps(config: TrainConfig, model_name: str, model_config: ModelConfig, seq_len: int) -> TrainConfig:
    """``config`` with run.steps the step count of its budget in tokens or FLOPs for model
    ``model_name`` (whose ModelConfig is ``model_config``) at ``seq_len`` tokens per sequence;
    unchanged without a budget or with one in seconds. A budget smaller than one step, or a
    run.stop_at_step beyond its steps, is a ConfigError naming it. Idempotent."""
    run = config.run
    budget = run.budget
    if budget is not None and budget.kind == "seconds" and budget.amount > MAX_SECONDS:
        raise ConfigError(f"run.budget.amount={budget.amount:g} seconds is more than a year of training; give at "
                          f"most {MAX_SECONDS:g}")
    if budget is None or budget.kind == "seconds":
        return config
    sequences = config.data.batch_size
    if budget.kind == "tokens":
        per_step = sequences * seq_len
        what = f"data.batch_size={sequences} × seq_len={seq_len} tokens"
    else:
        try:
            per_step = training_flops(model_config, seq_len).per_step(sequences)
        except UnknownAttentionCost as exc:
            raise ConfigError(f"run.budget.kind=flops: models.{model_name}: {exc}") from None
        what = f"{per_step:.4g} training FLOPs of models.{model_name} (diff_transformer.flops)"
    steps = int(budget.amount // per_step)
    if steps > MAX_STEPS:
        raise ConfigError(f"run.budget.amount={budget.amount:g} {budget.kind} is {steps:.3g} optimizer steps of "
                          f"models.{model_name} at {per_step:.4g} {budget.kind} a step, beyond the {MAX_STEPS:.0e} "
                          f"steps any run takes; give at most {MAX_STEPS * per_step:.4g}")
    if steps < 1:
        raise ConfigError(f"run.budget.amount={budget.amount:g} {budget.kind} is less than one optimizer step "
                          f"({what}); give at least {per_step:.4g}")
    if run.stop_at_step is not None and run.stop_at_step > steps:
        raise ConfigError(f"run.stop_at_step={run.stop_at_step} lies beyond the {steps} steps of "
                          f"run.budget ({budget.amount:g} {budget.kind} for models.{model_name})")
    return dataclasses.replace(config, run=dataclasses.replace(run, steps=steps))
