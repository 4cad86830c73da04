"""Joining torchrun's process group (DDP): NCCL on GPU, gloo on CPU; one process is world size 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftsmith.errors import TrainingError
from draftsmith.train.settings import TrainSettings


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def use_cuda(settings: TrainSettings) -> bool:
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is cuda but no CUDA device is visible", where="device",
                            fix="set device: cpu, or run where a GPU is visible")
    return settings.device != "cpu" and torch.cuda.is_available()


def init_distributed(cuda: bool) -> Dist:
    """Join the torchrun process group if there is one (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return Dist()
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)
