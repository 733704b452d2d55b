"""Static KV cache for a contiguous range of layers, written by position.

Rollback is implicit: a write at slot `q` makes `q + T` the visible length for that step, so
a stage that receives a token at position `q` simply overwrites whatever stale entries sat at
`q` and beyond (docs/design.md 3.4). Buffers are preallocated once; no step allocates.
"""
from __future__ import annotations

import torch

from spd_engine.engine.model_config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, layers: range, batch: int, capacity: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.layers = layers
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layers}  # [B, nkv, S, hd]
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layers}

    def write(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, nkv, T, hd] at slots [slot0, slot0+T); return the visible [B, nkv, slot0+T, hd]."""
        end = slot0 + k.shape[2]
        assert end <= self.capacity, (end, self.capacity)
        self.k[layer][:, :, slot0:end] = k
        self.v[layer][:, :, slot0:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
