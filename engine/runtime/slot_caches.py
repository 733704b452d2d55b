"""A stage's KV caches, one per request slot (docs/design.md 3.12), and where a BATCH step's rows
go in them.

Slot 0's cache is made with the stage; another slot's on its first use. Every cache holds the
chain slots' headroom too (docs/design.md 3.11): any request may branch.
"""
from __future__ import annotations

import torch

from spd_engine.engine.model.kv_cache import KVCache, RowCaches, chain_mask, chain_slot0
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.messages import META_FIELDS

MAX_SLOTS = 64  # request slots a stage accepts (one KV cache each, made on first use)
_CHAIN_FIELDS = [META_FIELDS.index(f) for f in ("slot", "position", "branch", "chain", "width", "survivor")]


class SlotCaches:
    """Request slot -> its KV cache of `capacity` positions."""

    def __init__(self, model: StageModel, stage: int, capacity: int) -> None:
        self.model, self.stage = model, stage
        self.first = model.new_cache(1, capacity)  # slot 0: one request alone, the static step's
        self.caches: dict[int, KVCache] = {0: self.first}

    def of(self, slot: int) -> KVCache:
        """Request slot `slot`'s KV cache, made on its first use."""
        cache = self.caches.get(slot)
        if cache is None:
            if not 0 <= slot < MAX_SLOTS:
                raise RuntimeError(f"stage {self.stage}: request slot {slot} is outside 0..{MAX_SLOTS - 1}")
            cache = self.caches[slot] = self.model.new_cache(1, self.first.capacity)
        return cache

    def batch_rows(self, meta: torch.Tensor, device: torch.device) -> RowCaches:
        """Where a BATCH step's rows (table meta [R, META_LEN]) go: a request's token at its position
        in its slot's cache (a suffix run's consecutive rows as one causal span); the W chains of its
        branch point (consecutive rows) as one group at
        their chain slots under the tree mask (3.11). A survivor row first moves the surviving
        chain's entries down, as a TOKEN message naming it does: FIFO links brought every chain
        row of its branch point first."""
        groups = []  # (cache, first slot, rows, mask or None)
        for slot, pos, branch, chain, width, survivor in meta[:, _CHAIN_FIELDS].tolist():
            cache = self.of(slot)
            if survivor >= 0:
                cache.keep_chain(branch, width, survivor, pos - branch)
            if branch < 0 or survivor >= 0:  # one token, or the next of a suffix run's (3.13): one causal span
                last = groups[-1] if groups else None
                if survivor < 0 and last is not None and last[0] is cache and last[3] is None and \
                        last[1] + last[2] == pos:
                    groups[-1] = (cache, last[1], last[2] + 1, None)
                else:
                    groups.append((cache, pos, 1, None))
            elif chain == 0:
                groups.append((cache, chain_slot0(branch, pos, width), width,
                               chain_mask(branch, pos, width, device)[0, 0]))  # [W, slot0 + W]
        caches, starts, counts, masks = (list(x) for x in zip(*groups))
        assert sum(counts) == len(meta), f"stage {self.stage}: a BATCH message's chain rows are not grouped"
        return RowCaches(caches, starts, counts, masks)
