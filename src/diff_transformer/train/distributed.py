"""Processes, devices and parallelism, applied from outside the model.

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) each process joins the
process group (nccl on GPU, gloo on CPU); alone, nothing is initialised and the helpers below
degrade to no-ops, so the trainer has one code path.

Parallelism wraps a plain :class:`LanguageModel` in a fixed order:
  - ``"ddp"``: DistributedDataParallel; every process holds the whole model.
  - ``"fsdp"``: FSDP2 ``fully_shard`` on each transformer block, then on the root (embedding,
    final norm, LM head); parameters become DTensors sharded over the processes.
The initial weights are the same whatever the number of processes: rank 0's seeded full init
is broadcast into the shards (see :func:`parallelize`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError


@dataclass(frozen=True)
class Environment:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool = False  # setup() created it, so teardown() destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """run.device as a torch device: "auto" is CUDA when there is a GPU, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device: str = "auto") -> Environment:
    """Pick the device and, under torchrun, join the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = resolve_device(device, local_rank)
    if torch_device.type == "cuda":
        torch.cuda.set_device(local_rank)
    owns = False
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch_device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        owns = True
    return Environment(rank, world_size, local_rank, torch_device, owns)


def teardown(env: Environment) -> None:
    """Leave the process group if :func:`setup` joined it (not one the caller set up)."""
    if env.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], env: Environment) -> list[float]:
    """Sum a few floats over all processes (returned unchanged when alone)."""
    if not env.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_from_main(value, env: Environment):
    """Rank 0's ``value`` (any picklable object) on every process (``value`` itself when alone)."""
    if not env.distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather(value, env: Environment) -> list:
    """Every process's ``value`` (any picklable object), in rank order (``[value]`` when alone)."""
    if not env.distributed:
        return [value]
    values = [None] * env.world_size
    dist.all_gather_object(values, value)
    return values


def parallelize(model_factory, env: Environment, parallel: str, seed: int) -> nn.Module:
    """Build the model with ``model_factory(device)`` and wrap it for ``env``.

    ``model_factory(device)`` returns a LanguageModel on ``device``, initialised from the global
    RNG (seeded here with ``seed``), or unallocated when ``device == "meta"``.
    """
    if not env.distributed:
        torch.manual_seed(seed)
        return model_factory(env.device)
    if parallel == "ddp":
        torch.manual_seed(seed)
        model = model_factory(env.device)  # the same weights on every rank; DDP also broadcasts rank 0's
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if parallel == "fsdp":
        return _fully_shard(model_factory, env, seed)
    raise ValueError(f"unknown parallelism {parallel!r}; choose ddp or fsdp")


def _fully_shard(model_factory, env: Environment, seed: int) -> nn.Module:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    full_state = {}
    if env.is_main:  # the reference init, on CPU, as a single process would make it
        torch.manual_seed(seed)
        full_state = model_factory(torch.device("cpu")).state_dict()
    model = model_factory("meta")
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=env.device)
    set_model_state_dict(
        model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The LanguageModel inside a DDP wrapper (an FSDP2 model is its own module)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
