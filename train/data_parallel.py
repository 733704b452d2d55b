"""Data parallelism for `spd train` under torchrun: one process per device, each on its own batches.

Every rank holds the whole (small) PDM and the frozen target; after each backward the PDM
gradients are averaged with one all-reduce over a flat buffer, so every rank takes the same
optimizer step. The batch stream is shared: rank r keeps batches r, r + world, ... of it.
gloo on CPU, NCCL on CUDA. A single process (no torchrun) is world 1 and never communicates.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _import_world_capturing_modules() -> None:
    """Import, before the process group exists, the torch modules that capture it at import time.

    `torch.distributed.nn.functional` takes `group=group.WORLD` as default arguments, evaluated on
    import: imported after `init_process_group` (torch._dynamo imports it, and AdamW imports
    torch._dynamo when it is built), its functions hold the default group for the life of the
    process, so `destroy_process_group` leaves gloo's threads running, and tearing them down during
    interpreter exit aborted a rank now and then ("terminate called without an active exception").
    Imported first, the defaults are None and the group is freed when it is destroyed."""
    import torch.distributed.nn.functional  # noqa: F401


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad data-parallel rank {self.rank} of world {self.world}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str, timeout_s: float = 600.0) -> "DataParallel":
        """World 1 unless started by torchrun (WORLD_SIZE > 1): then join the process group."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            _import_world_capturing_modules()
            backend = "nccl" if device.startswith("cuda") else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(local)  # before the group: NCCL binds its communicators to it
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, local)

    def device(self, device: str) -> str:
        """The rank's own device: `cuda` becomes `cuda:LOCAL_RANK` when several ranks share a node."""
        if device == "cuda" and self.world > 1:
            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return device

    def shard(self, batches: Iterable) -> Iterator:
        """This rank's share of a batch stream that every rank draws identically."""
        return itertools.islice(batches, self.rank, None, self.world)

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Mean of every rank's gradients, in place; one collective per step."""
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= self.world
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)

    def mean(self, value: float) -> float:
        """Mean of a per-rank scalar (for logging)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return float(t) / self.world

    def close(self) -> None:
        """Leave together: a gloo rank that closes its connections while the main rank still
        saves (and then tears down its own) can abort the peer mid-teardown."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
