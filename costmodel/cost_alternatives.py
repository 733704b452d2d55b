"""The resource-matched alternatives to SPD in the cost model, per generated token: one device
autoregressive (AR), plain pipeline parallel (PP) and tensor parallel (TP) at batch 1. Pure
arithmetic: no torch. Times are milliseconds.
"""
from __future__ import annotations

from spd_engine.costmodel.cost_inputs import LinkModel, Profile, message_bytes, note


def tp_shard_layer_ms(profile: Profile, g: int, notes: list[str]) -> tuple[float, ...]:
    """Per-layer time of a 1/g-width shard: measured if given, else the ideal layer_ms / g (flagged)."""
    if g in profile.tp_layer_ms:
        scale = profile.tp_layer_ms[g] / (sum(profile.layer_ms) / profile.num_layers)
        return tuple(t * scale for t in profile.layer_ms)
    note(notes, "ASSUMPTION: TP shard compute = layer time / g where the profile has no tp_layer_ms for g "
                "(ideal scaling; batch-1 shards scale worse, so this flatters TP)")
    return tuple(t / g for t in profile.layer_ms)


def tp_reduce_ms(profile: Profile, g: int, link: LinkModel, notes: list[str]) -> float:
    """One all-reduce of a hidden state over g TP ranks between shard layers: the profile's, where
    it was measured in lockstep with the shards' compute (as the runtime pays it), else the link's."""
    if g in profile.tp_allreduce_ms:
        note(notes, f"TP all-reduce over {g} ranks: the profile's {profile.tp_allreduce_ms[g]:.3f} ms, measured in "
                    f"lockstep with the shards' compute (bench/tp_shard_time.py), not the link's back-to-back figure")
        return profile.tp_allreduce_ms[g]
    return link.allreduce_ms(g, profile.hidden * profile.dtype_bytes, notes)


def ar_token_ms(profile: Profile) -> float:
    """Autoregressive decoding on one device: every layer, then the head."""
    return sum(profile.layer_ms) + profile.stage_fixed_ms + profile.verify_ms


def pp_token_ms(profile: Profile, stage_ms: list[float], link_of, head_ms: float) -> float:
    """Plain pipeline parallel on n devices (head on the last stage, `head_ms` unless the last
    stage time includes it): one token through all stages, then its successor: n hops per token
    (n-1 activations + the token back to stage 0)."""
    n = len(stage_ms)
    sizes = message_bytes(profile.hidden, profile.dtype_bytes, profile.anchors, table=False)
    hops = sum(link_of(p, p + 1).hop_ms(sizes["activation"]) for p in range(n - 1))
    hops += link_of(n - 1, 0).hop_ms(sizes["token"])
    return sum(stage_ms) + head_ms + hops


def vocab_parallel_head_ms(profile: Profile, g: int, link: LinkModel, notes: list[str]) -> float:
    """The head of a stage over g TP ranks (each holds 1/g of the vocabulary's rows, docs/design.md
    3.9): verify_ms / g, then one 8-byte all-reduce to pick the argmax across the shards."""
    note(notes, "ASSUMPTION: TP head = verify_ms / g (vocab-parallel) + one 8-byte all-reduce for the argmax")
    return profile.verify_ms / g + link.allreduce_ms(g, 8, notes)


def tp_token_ms(profile: Profile, g: int, link: LinkModel, notes: list[str]) -> tuple[float, float]:
    """Tensor parallel over g devices at batch 1, as the runtime runs it (engine/model/tp_model.py): 1/g
    shards, two all-reduces of [1, H] per layer and one for the vocab-parallel embedding, a
    vocab-parallel head (verify / g) and one small all-reduce to pick the argmax; the next token
    reaches the other TP ranks in one hop (the embedding's all-reduce waits for it).
    Returns (ms per token, ms of it in all-reduces and that hop)."""
    shard = tp_shard_layer_ms(profile, g, notes)
    comm = (2 * profile.num_layers + 1) * tp_reduce_ms(profile, g, link, notes) + link.allreduce_ms(g, 8, notes)
    comm += link.hop_ms(message_bytes(profile.hidden, profile.dtype_bytes, profile.anchors, table=False)["token"])
    note(notes, "ASSUMPTION: TP head = verify_ms / g (vocab-parallel) + one 8-byte all-reduce for the argmax")
    return sum(shard) + profile.stage_fixed_ms + profile.verify_ms / g + comm, comm
