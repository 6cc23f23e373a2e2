"""DDP plumbing for ``torchrun``: env:// init, NCCL on CUDA and gloo on CPU, and rank-summed metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "all_gather_objects", "all_reduce_sum", "cleanup_distributed", "init_distributed",
           "is_distributed", "resolve_device"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``; ``device`` is the one it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; under torchrun each process takes GPU ``LOCAL_RANK``."""
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        return torch.device(device if ":" in device else f"cuda:{local_rank}")
    return torch.device("cpu")


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment (or run alone without it).

    ``WORLD_SIZE`` > 1 starts an ``env://`` process group: NCCL when training on CUDA, gloo on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world > 1 and not is_distributed():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":  # bind the process group to this rank's GPU
            dist.init_process_group(backend=backend, init_method="env://", device_id=dev)
        else:
            dist.init_process_group(backend=backend, init_method="env://")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def cleanup_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place (a no-op when running alone); returns ``t``."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` when running alone); pickled, so only small things."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
