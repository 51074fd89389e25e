"""One optimizer step, as every training of the project takes it: the trainer's runs, the retrieval
experiment's small models and the transformers reference check all step through this module, so a
change of the recipe (the optimizer, its parameter groups, clipping, the schedule, the loss
normalisation) reaches every study.

    gradients = forward_backward(model, forward_model, batches, env, parallel, autocast)
    grad_norm = clip_gradients(raw_model, optim.grad_clip)
    advance(optimizer, schedule)

:class:`InProcessTraining` puts the three together for a model trained in this process on one
device (no wrappers, no torchrun): ``training.step(inputs, targets)`` is one optimizer step.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Sequence

import torch
from torch import Tensor, nn

from ..loss import IGNORE_INDEX
from ..model import document_ids
from .config import OptimConfig
from .distributed import Environment, all_reduce_sum
from .optim import WarmupLinearSchedule, build_optimizer

Batch = tuple[Tensor, Tensor]  # (inputs, targets), each (b, T); targets -100 where not counted


def token_loss_sum(model: nn.Module, inputs: Tensor, targets: Tensor, separator: int | None = None) -> Tensor:
    """Sum of the cross-entropy over the counted targets (those not -100), in fp32, without the
    logits (the model's fused head and loss; called through DDP / FSDP / compile wrappers). With
    ``separator`` (data.packing: documents), a document starts at each such token of ``inputs``
    and attention stays within each (:func:`~diff_transformer.model.document_ids`)."""
    if separator is None:
        return model(inputs, targets, return_logits=False, reduction="sum")[1]
    documents = document_ids(inputs, separator)
    return model(inputs, targets, return_logits=False, reduction="sum", document_ids=documents)[1]


def _no_gradient_sync(model: nn.Module, parallel: str, last_micro_batch: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    if parallel == "fsdp" and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()


def forward_backward(model: nn.Module, forward_model: nn.Module, batches: Sequence[Batch], env: Environment,
                     parallel: str = "ddp", autocast: AbstractContextManager | None = None,
                     separator: int | None = None) -> tuple[float, int]:
    """Accumulate the gradient of the global batch's mean loss over this process's micro-batches.

    The targets of the whole global batch are counted first (one all-reduce) and each micro-batch's
    loss sum is divided by that count, so the step's loss is the mean over every counted target of
    the global batch, however it is cut (with one micro-batch in one process, exactly the model's
    own mean). ``model`` is what gradients are synchronised through (DDP / FSDP), ``forward_model``
    what is called (``model`` or its compiled form). ``separator``: packed documents, as in
    :func:`token_loss_sum`. Returns (this process's loss sum, the global count).
    """
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    local_count = sum(int((t != IGNORE_INDEX).sum()) for _, t in batches)
    (global_count,) = all_reduce_sum([local_count], env)
    global_count = int(global_count)
    loss_sum = torch.zeros((), device=env.device)
    for m, (inputs, targets) in enumerate(batches):
        inputs, targets = inputs.to(env.device, non_blocking=True), targets.to(env.device, non_blocking=True)
        with _no_gradient_sync(model, parallel, last_micro_batch=m == len(batches) - 1):
            with autocast:
                micro_sum = token_loss_sum(forward_model, inputs, targets, separator)
            # DDP and FSDP average the gradients over processes: × world_size makes that a sum.
            # A global batch with no counted target contributes no gradient.
            (micro_sum * env.world_size / max(global_count, 1)).backward()
        loss_sum += micro_sum.detach()
    return float(loss_sum), global_count


def clip_gradients(model: nn.Module | Sequence[Tensor], grad_clip: float) -> float:
    """Clip the global gradient norm to ``grad_clip`` (0: no clipping); the norm before clipping.
    ``model``: the model, or its parameters listed once (``model.parameters()`` walks every module
    each time: ~1 ms a step at a small model on a CPU core).

    Gradients of one device and dtype (plain tensors) take clip_grad_norm_'s own foreach arithmetic
    without its grouping by device and dtype (half of its time at a small model's ~30 tensors, ~0.5 ms
    a step on a CPU core), bit for bit the same; others (FSDP's DTensors, several devices) take
    clip_grad_norm_ itself."""
    parameters = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    first = grads[0]
    if all(type(g) is torch.Tensor and g.device == first.device and g.dtype == first.dtype for g in grads) and (
            first.device.type in ("cpu", "cuda")):
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        if grad_clip > 0:  # (clip_grad_norm_'s factor at an infinite max_norm is 1: no change)
            torch._foreach_mul_(grads, torch.clamp(grad_clip / (total + 1e-6), max=1.0))
        return float(total)
    parameters = model.parameters() if isinstance(model, nn.Module) else model
    norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    return float(norm)


def advance(optimizer: torch.optim.Optimizer, schedule: WarmupLinearSchedule) -> None:
    """The optimizer step, then the schedule's: the next step uses the next learning rate."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()


CPU = Environment(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class InProcessTraining:
    """A model trained in this process on one device with the trainer's optimizer (AdamW, its
    parameter groups), schedule, clipping and loss normalisation: the retrieval experiment's small
    models and the transformers reference check. ``step(inputs, targets)`` is one optimizer step
    on one batch; returns its mean loss per counted target."""

    def __init__(self, model: nn.Module, optim: OptimConfig, total_steps: int, env: Environment = CPU) -> None:
        self.model, self.optim, self.env = model, optim, env
        self.optimizer = build_optimizer(model, optim, env.device)
        self.schedule = WarmupLinearSchedule(self.optimizer, optim, total_steps)
        self.parameters = list(model.parameters())
        self.last_grad_norm: float | None = None

    def step(self, inputs: Tensor, targets: Tensor) -> float:
        self.model.train()
        loss_sum, count = forward_backward(self.model, self.model, [(inputs, targets)], self.env)
        self.last_grad_norm = clip_gradients(self.parameters, self.optim.grad_clip)
        advance(self.optimizer, self.schedule)
        return loss_sum / max(count, 1)
