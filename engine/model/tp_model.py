"""A tensor-parallel stage shard (Megatron-style) and the serial reference of a TP split.

`TPStageModel` is one TP rank's part of a stage: its modules are ordinary engine modules built
with the shard's shape (engine/model/tp_shard.py `shard_config`), so the attention runs its own query
groups and the MLP its slice of the intermediate dimension. The row-parallel outputs (attention
`linear_proj`, MLP `linear_fc2`) are partial sums, reduced once each per layer over the stage's
TP group (`DecoderLayer.reduce`); the vocab-parallel embedding looks up its own rows, zeroes the
others and is reduced once; the vocab-parallel head gives this rank's logits, and the next token
is chosen across ranks (engine/model/tp_sampling.py). Every rank ends a layer with the full hidden state.

`SerialTP` runs the T shards of a split in one thread, in lockstep, adding the partial sums in
the same order as the group's all-reduce (`reduce_parts`): it is the greedy oracle "with the
same TP split", bit-identical to the TP runtime over threads or processes on one machine.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from spd_engine.engine.comm.tp_group import TPGroup, reduce_parts
from spd_engine.engine.model.kv_cache import KVCache
from spd_engine.engine.model.model import StageModel, causal_mask
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.tp_sampling import tp_argmax_rows, tp_sample
from spd_engine.engine.model.tp_shard import shard_config, vocab_range
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.kernels.packed_linear import PackedLinear


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this rank holds: its parameters (a tied embedding / head counted once)
    and its packed linears' weights (kernels/packed_linear.py: not Parameters; the mixed layout's
    column-major copy too)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.resident_bytes() for m in model.modules() if isinstance(m, PackedLinear))


class TPStageModel(StageModel):
    """TP rank `group.rank` of `group.size` of layers `layers` (+ embedding / final norm + head).
    `cfg` stays the full model's shape; `local_cfg` is the shard's."""

    def __init__(self, cfg: ModelConfig, layers: range, group: TPGroup, embedding: bool = False,
                 head: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        local = shard_config(cfg, group.size)
        super().__init__(local, layers, embedding=embedding, head=head, device=device, dtype=dtype)
        self.cfg, self.local_cfg, self.group = cfg, local, group
        self.vocab = vocab_range(cfg, group.size, group.rank)
        for layer in self.decoder.layers.values():
            layer.reduce = group.all_reduce  # the row-parallel partial sums: one all-reduce each

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.local_cfg, self.layer_range, batch, capacity, p.device, p.dtype)  # local KV heads

    def local_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> this shard's rows [B, T, H], zero for ids outside its vocabulary."""
        local = tokens - self.vocab.start
        inside = (local >= 0) & (local < len(self.vocab))
        rows = self.embedding.word_embeddings(local.clamp(0, len(self.vocab) - 1))
        return torch.where(inside[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, H]: one all-reduce of the masked rows (exact: x + 0 = x)."""
        return self.group.all_reduce(self.local_embed(tokens))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits: h [..., H] -> [..., V/T] (fp32)."""
        return super().logits(h)

    def use_head_screen(self) -> bool:
        raise ValueError("the int8 head screen needs the whole head on one rank; a TP stage picks its token "
                         "across ranks (choose_token)")

    def greedy_token(self, h: torch.Tensor) -> int:
        raise AssertionError("a TP stage's logits are a vocabulary shard: use choose_token")

    def choose_token(self, local_logits: torch.Tensor, sampling: SamplingParams, pos: int) -> int:
        """The token for position `pos` from local logits [V/T]: argmax or a keyed draw, across ranks."""
        return tp_sample(self.group, local_logits, self.vocab.start, self.cfg.vocab_size, sampling, pos)

    def argmax_rows(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token from local logits [R, V/T], across ranks: ids [R] (int64, host)."""
        return tp_argmax_rows(self.group, local_logits, self.vocab.start)


class _NoGroup(TPGroup):
    """The rank/size of one shard of a serial split; its collectives are done by `SerialTP`."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.members = rank, size, tuple(range(size))

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        raise AssertionError("a serial TP shard does not communicate")


class SerialTP:
    """The T shards of a whole model in one thread; the interface `greedy_generate` uses.

    head None: the vocab-parallel head (logits gathered from the shards); else the given
    unsharded model's final norm + head (the SPD driver's)."""

    def __init__(self, shards: Sequence[TPStageModel], head: StageModel | None = None) -> None:
        assert shards and all(s.layer_range == shards[0].layer_range for s in shards)
        self.shards, self.head = list(shards), head
        self.cfg = shards[0].cfg

    @classmethod
    def build(cls, make_shard, tp: int, head: StageModel | None = None) -> "SerialTP":
        """make_shard(group) -> that TP rank's TPStageModel of the whole model."""
        return cls([make_shard(_NoGroup(r, tp)) for r in range(tp)], head)

    def parameters(self):
        return self.shards[0].parameters()

    def new_cache(self, batch: int, capacity: int) -> list[KVCache]:
        return [s.new_cache(batch, capacity) for s in self.shards]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return reduce_parts([s.local_embed(tokens) for s in self.shards])

    def forward_layers(self, h: torch.Tensor, caches: list[KVCache], slot0: int, positions=None, mask=None,
                       capture: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As StageModel.forward_layers (unpadded batch), every layer's partial sums reduced in rank order."""
        B, T, _ = h.shape
        assert positions is None and mask is None, "the serial TP oracle runs unpadded sequences"
        first = self.shards[0]
        positions = torch.arange(slot0, slot0 + T, device=h.device).expand(B, T)
        mask = causal_mask(slot0, T, h.device)
        cos_t, sin_t = first.rope(h.device)
        cos, sin = cos_t[positions], sin_t[positions]
        captured = {}
        for i in first.layer_range:
            layers = [s.decoder.layers[str(i)] for s in self.shards]
            h = h + reduce_parts([lay.self_attention(lay.input_layernorm(h), i, c, slot0, cos, sin, mask)
                                  for lay, c in zip(layers, caches)])
            h = h + reduce_parts([lay.mlp(lay.pre_mlp_layernorm(h)) for lay in layers])
            if i in capture:
                captured[i] = h
        return h, captured

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full logits [..., V] (fp32): the shards' concatenated, or the unsharded head's."""
        if self.head is not None:
            return self.head.logits(h)
        return torch.cat([s.logits(h) for s in self.shards], dim=-1)

    def greedy_token(self, h: torch.Tensor) -> int:
        return int(self.logits(h).argmax())  # host sync: the caller needs the id
