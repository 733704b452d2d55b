"""Warm start a PDM for one stage split from a head trained for another (`spd train --init-head`).

Everything but the anchor projections is independent of the split: the K decoder layers, the
frozen final norm and the draft-vocabulary head are copied as they are. A projection reads the
concatenated anchor states of its type; each anchor of the new type takes the block of the
source anchor nearest to it in layer index (each source block used once, deepest first), from
the source type whose deepest anchor is nearest to the new type's deepest. Blocks with no
source stay zero. So a head trained at n = 4 starts an n = 2 head with everything it learnt
about drafting from (roughly) the same depths; fine-tuning adapts the projections.
"""
from __future__ import annotations

import torch

from spd_engine.engine.model.pdm import PDM


def _nearest(candidates: list[int], layer: int) -> int:
    """Index in `candidates` of the layer nearest to `layer` (ties: the deeper)."""
    return min(range(len(candidates)), key=lambda i: (abs(candidates[i] - layer), -candidates[i]))


def anchor_map(src_anchors: tuple[int, ...], dst_anchors: tuple[int, ...], a: int) -> tuple[int, dict[int, int]]:
    """(source type, {destination anchor index -> source anchor index}) for destination type `a`."""
    b = _nearest(list(src_anchors), dst_anchors[a])
    free = list(range(b + 1))
    mapping: dict[int, int] = {}
    for i in range(a, -1, -1):  # deepest first, so the deepest anchors pair up
        if not free:
            break
        j = free[_nearest([src_anchors[k] for k in free], dst_anchors[i])]
        mapping[i] = j
        free.remove(j)
    return b, mapping


@torch.no_grad()
def transplant(src: PDM, dst: PDM) -> PDM:
    """Fill `dst` (another split of the same target, K and draft vocabulary) from `src`."""
    if src.pcfg.num_layers != dst.pcfg.num_layers:
        raise ValueError(f"--init-head has K={src.pcfg.num_layers} decoder layers, this run has K={dst.pcfg.num_layers}")
    if src.pcfg.draft_vocab != dst.pcfg.draft_vocab:
        raise ValueError("--init-head has another draft vocabulary than this run (pass its --draft-vocab)")
    shared = {k: v for k, v in src.state_dict().items() if not k.startswith("proj.")}
    missing, unexpected = dst.load_state_dict(shared, strict=False)
    assert all(k.startswith("proj.") for k in missing) and not unexpected, (missing, unexpected)
    H = dst.target_cfg.hidden_size
    sa, da = src.pcfg.anchors, dst.pcfg.anchors
    for a, p in enumerate(dst.proj):
        b, mapping = anchor_map(sa, da, a)
        w = src.proj[b].weight  # [H, (b+1)H]
        p.weight.zero_()
        for i, j in mapping.items():
            p.weight[:, i * H:(i + 1) * H] = w[:, j * H:(j + 1) * H]
    dst._packed = None
    return dst
