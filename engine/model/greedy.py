"""Reference greedy decoder on one process: the oracle every SPD result is compared with.

Static KV cache written by position, prefill in fixed chunks (`prefill_chunks`, shared with the
pipelined prefill so both run identical shapes), then one token per step. A batched variant
(left-padded) serves data generation, where throughput matters more than bit equality.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from spd_engine.engine.model.kv_cache import KVCache
from spd_engine.engine.model.model import StageModel

DEFAULT_PREFILL_CHUNK = 128


def prefill_chunks(length: int, chunk: int = DEFAULT_PREFILL_CHUNK) -> list[tuple[int, int]]:
    """(start, count) pieces covering positions [0, length)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    return [(s, min(chunk, length - s)) for s in range(0, length, chunk)]


def check_request(prompt: Sequence[int], max_new_tokens: int, capacity: int, vocab_size: int) -> None:
    """Clear errors for requests the engine cannot serve, before any work starts."""
    if len(prompt) == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > capacity:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"KV cache capacity of {capacity} positions")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


@torch.no_grad()
def prefill(model: StageModel, cache: KVCache, prompt: Sequence[int], chunk: int = DEFAULT_PREFILL_CHUNK
            ) -> torch.Tensor:
    """Run the prompt through the whole model; return the final hidden state of its last position [H]."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    h = None
    for start, count in prefill_chunks(len(prompt), chunk):
        h, _ = model.forward_layers(model.embed(ids[None, start:start + count]), cache, start)
    return h[0, -1]


@torch.no_grad()
def greedy_generate(model: StageModel, prompt: Sequence[int], max_new_tokens: int,
                    eos_ids: Sequence[int] = (), chunk: int = DEFAULT_PREFILL_CHUNK,
                    capacity: int | None = None) -> list[int]:
    """Greedy continuation of `prompt`: stops after max_new_tokens or at the first EOS (included)."""
    capacity = capacity or len(prompt) + max_new_tokens
    check_request(prompt, max_new_tokens, capacity, model.cfg.vocab_size)
    cache = model.new_cache(1, capacity)
    device = next(model.parameters()).device
    h = prefill(model, cache, prompt, chunk)
    out: list[int] = []
    eos = set(eos_ids)
    token = torch.empty(1, 1, dtype=torch.long, device=device)
    for pos in range(len(prompt), len(prompt) + max_new_tokens):
        next_id = model.greedy_token(h)  # host sync: the decode loop needs the id
        out.append(next_id)
        if next_id in eos or len(out) == max_new_tokens:
            break
        token.fill_(next_id)
        h, _ = model.forward_layers(model.embed(token), cache, pos)
        h = h[0, -1]
    return out


@torch.no_grad()
def greedy_generate_batch(model: StageModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          eos_ids: Sequence[int] = ()) -> list[list[int]]:
    """Greedy decoding of several prompts at once (left-padded). Near-ties may differ from
    `greedy_generate` (other shapes, other kernels); use it for throughput, not as the oracle."""
    for p in prompts:
        check_request(p, max_new_tokens, 1 << 30, model.cfg.vocab_size)
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    capacity = P + max_new_tokens
    pads = torch.tensor([P - len(p) for p in prompts], device=device)  # [B]
    ids = torch.zeros(B, P, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
    cols = torch.arange(capacity, device=device)
    valid = cols[None, :] >= pads[:, None]  # [B, S]: not a pad slot
    cache = model.new_cache(B, capacity)
    rows = torch.arange(P, device=device)
    mask = (valid[:, None, :P] & (cols[None, None, :P] <= rows[None, :, None]))[:, None]  # [B, 1, P, P]
    positions = (rows[None, :] - pads[:, None]).clamp(min=0)
    h, _ = model.forward_layers(model.embed(ids), cache, 0, positions=positions, mask=mask)
    h = h[:, -1:]
    outs: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    for step in range(max_new_tokens):
        nxt = model.logits(h)[:, -1].argmax(-1)  # [B]
        for b in range(B):
            if not done[b]:
                outs[b].append(int(nxt[b]))
        done |= torch.isin(nxt, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        slot = P + step
        mask = valid[:, None, None, :slot + 1]  # [B, 1, 1, slot+1]
        h, _ = model.forward_layers(model.embed(nxt[:, None]), cache, slot,
                                    positions=(slot - pads)[:, None], mask=mask)
    return outs
