"""Static KV cache for a contiguous range of layers, written by position.

Rollback is implicit: a write at slot `q` makes `q + T` the visible length for that step, so
a stage that receives a token at position `q` simply overwrites whatever stale entries sat at
`q` and beyond (docs/design.md 3.4). Buffers are preallocated once; no step allocates.

Branch width W (docs/design.md 3.11): the chains of a branch point at position `q` write their
entries for position `p >= q` at slots `q + (p - q) W + c` (chain c), so a chain step writes W
contiguous slots and sees the shared prefix below `q` (a tree mask selects its own chain above
it). `keep_chain` moves the survivor's entries down to slots `q, q + 1, ...`, after which the
cache is what a single chain would have written.

Several requests (docs/design.md 3.12): a stage keeps one cache per request slot, and a stage
step over the rows of several requests attends each row to its own request's cache through
`RowCaches`, while the step's matmuls run over all rows at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_engine.engine.model.model_config import ModelConfig


def chain_slot0(q: int, pos: int, width: int) -> int:
    """First slot of the chains' entries for position `pos` of the branch point at `q`."""
    return q + (pos - q) * width


def chain_mask(q: int, pos: int, width: int, device: torch.device) -> torch.Tensor:
    """Bool [1, 1, W, slot0 + W]: chain c's token at `pos` sees slots below q and its own chain's
    entries at q .. pos (slots q + i*W + c), not its siblings'."""
    end = chain_slot0(q, pos, width) + width
    cols = torch.arange(end, device=device)
    chain = torch.arange(width, device=device)[:, None]
    return ((cols < q) | ((cols >= q) & ((cols - q) % width == chain)))[None, None]


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

    def keep_chain(self, q: int, width: int, row: int, count: int) -> None:
        """Chain `row` of the branch point at `q` survived: its entries of positions q .. q+count-1
        (slots q + i*width + row) move to slots q .. q+count-1."""
        assert 0 <= row < width and q + count * width <= self.capacity, (q, width, row, count, self.capacity)
        device = next(iter(self.k.values())).device
        src = torch.arange(count, device=device) * width + (q + row)  # [count]
        for layer in self.layers:
            for buf in (self.k[layer], self.v[layer]):
                buf[:, :, q:q + count] = buf[:, :, src]  # the gather copies first: overlapping slots are safe

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class RowCaches:
    """The caches of a step whose rows belong to several requests: request i's `counts[i]` rows
    (consecutive slots from `starts[i]`, causal among themselves) use its cache `caches[i]`.
    One row each: a stage step over several requests' tokens; several: the PDM's pass over every
    request's rows (docs/design.md 3.12). `masks[i]` (bool [count, start + count], None: causal)
    overrides request i's mask: the chains of its branch point (chain_mask, 3.11)."""

    def __init__(self, caches: list[KVCache], starts: list[int], counts: list[int] | None = None,
                 masks: list[torch.Tensor | None] | None = None) -> None:
        counts = [1] * len(caches) if counts is None else counts
        masks = [None] * len(caches) if masks is None else masks
        assert len(caches) == len(starts) == len(counts) == len(masks) and caches, (len(caches), len(starts))
        for cache, start, count in zip(caches, starts, counts):
            if start < 0 or count < 1 or start + count > cache.capacity:
                raise ValueError(f"KV cache holds {cache.capacity} positions; writing at {start}..{start + count - 1}")
        self.caches, self.starts, self.counts, self.masks = caches, starts, counts, masks

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[1, rows] every row's position (its RoPE position)."""
        return torch.cat([torch.arange(s, s + c) for s, c in zip(self.starts, self.counts)])[None].to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """q [1, nh, R, hd], k/v [1, nkv, R, hd] -> [1, nh, R, hd]: each request's rows' K/V written
        at their slots in its own cache, its queries attending to that cache causally (or through
        the request's mask)."""
        out = torch.empty_like(q)
        r = 0
        for cache, start, count, mask in zip(self.caches, self.starts, self.counts, self.masks):
            rows = slice(r, r + count)
            keys, values = cache.write(layer, start, k[:, :, rows], v[:, :, rows])  # [1, nkv, start + count, hd]
            if mask is None and count > 1:  # row i sees slots <= start + i
                mask = torch.arange(start + count, device=q.device)[None] <= \
                    torch.arange(start, start + count, device=q.device)[:, None]
            out[:, :, rows] = F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask,
                                                             enable_gqa=gqa)
            r += count
        return out
