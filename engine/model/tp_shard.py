"""Tensor-parallel sharding of a stage's weights (Megatron's scheme). Pure tensor logic, no
torch.distributed.

Which part of each weight TP rank `r` of `tp` owns (docs/design.md 3.9):
  column-parallel linear_qkv: whole query groups (its q heads with their k and v), groups
      [r nkv/tp, (r+1) nkv/tp); tp must divide num_kv_heads and num_heads
  column-parallel linear_fc1: its gate shard stacked on its up shard (splitting the fused tensor
      in tp equal pieces would hand rank 0 only gate rows); a GeLU MLP's fc1 (one projection)
      split on dim 0 like any column-parallel layer
  norms (their LayerNorm biases too): replicated
  row-parallel linear_proj, linear_fc2: split on dim 1 (their outputs are partial sums)
  vocab-parallel embedding / output layer: rows [r V/tp, (r+1) V/tp); the vocabulary must be
      divisible by tp (no padding, so a round trip stays bit-identical)
  biases (Megatron's add_bias_linear): qkv's and fc1's split with their rows; a row-parallel
      layer's (linear_proj, linear_fc2) is added once to the reduced sum, so rank 0 holds it and
      the other ranks hold zeros (their partial sums then add nothing)
A shard's modules are ordinary engine modules built from `shard_config` (the model shape with
the local head, MLP and vocabulary counts), so a TP rank runs the same code as an unsharded one.
"""
from __future__ import annotations

import dataclasses

import torch

from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.model.tensor_names import EMBEDDING_KEY, LAYER_RE, OUTPUT_KEY

Tensor = torch.Tensor
# Which dim a tensor is split on under tensor parallelism (None: replicated). Column-parallel
# layers split their output rows, row-parallel ones their input columns, the vocabulary splits rows.
_TP_SPLIT_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc1.weight": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc2.weight": 1,
    EMBEDDING_KEY: 0,
    OUTPUT_KEY: 0,
}


_ROW_PARALLEL_BIASES = ("self_attention.linear_proj.bias", "mlp.linear_fc2.bias")


def tp_split_dim(name: str) -> int | None:
    """The dim this tensor is split on across TP ranks, or None when every rank holds it whole."""
    return _TP_SPLIT_DIM.get(LAYER_RE.sub("", name))


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming every dimension that `tp` does not divide."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be an integer >= 1, got {tp!r}")
    needs = {"num_kv_heads": cfg.num_kv_heads, "num_heads": cfg.num_heads,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    bad = [f"{k}={v}" for k, v in needs.items() if v % tp]
    if bad:
        raise ValueError(f"--tp {tp} does not divide {', '.join(bad)}: each TP rank needs whole query "
                         "groups and an equal share of the MLP and vocabulary")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape one TP rank's modules are built with: 1/tp of the heads, MLP and vocabulary."""
    check_tp(cfg, tp)
    if tp == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp)


def vocab_range(cfg: ModelConfig, tp: int, rank: int) -> range:
    """The token ids whose embedding rows and logits TP rank `rank` holds."""
    assert 0 <= rank < tp and cfg.vocab_size % tp == 0, (rank, tp, cfg.vocab_size)
    per = cfg.vocab_size // tp
    return range(rank * per, (rank + 1) * per)


def tensor_kind(name: str, cfg: ModelConfig | None = None) -> str:
    """qkv, fc1 (gate on up), rowbias, replicated, or dim<d> (split on dim d). `cfg` None: a SwiGLU
    model's fc1 (callers that may see a GeLU MLP pass the config)."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return "qkv"
    if (name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")) and (cfg is None or cfg.gated):
        return "fc1"
    if name.endswith(_ROW_PARALLEL_BIASES):
        return "rowbias"
    dim = tp_split_dim(name)
    return "replicated" if dim is None else f"dim{dim}"


def shard_tensor(name: str, t: Tensor, cfg: ModelConfig, tp: int) -> list[Tensor]:
    """One tensor -> its `tp` per-rank pieces (contiguous copies; replicated tensors are shared).
    `cfg` is the shape `t` belongs to (a TP piece is resharded with its own `shard_config`)."""
    kind = tensor_kind(name, cfg)
    if tp == 1:
        return [t]
    if kind == "qkv":
        per_rank = cfg.num_kv_heads // tp
        grouped = t.reshape(cfg.num_kv_heads, -1, *t.shape[1:])  # [groups, (qpg+2) hd, ...]
        return [grouped[r * per_rank:(r + 1) * per_rank].reshape(-1, *t.shape[1:]).contiguous()
                for r in range(tp)]
    if kind == "fc1":
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    if kind == "rowbias":
        return [t] + [torch.zeros_like(t)] * (tp - 1)
    if kind == "replicated":
        return [t] * tp
    dim = int(kind[3:])
    assert t.shape[dim] % tp == 0, (name, t.shape, tp)
    return [p.contiguous() for p in t.chunk(tp, dim)]


def merge_tensor(name: str, pieces: list[Tensor], cfg: ModelConfig | None = None) -> Tensor:
    """Inverse of `shard_tensor` (also for a consecutive run of pieces: it gives their union's
    piece). Replicated pieces must agree bit for bit. `cfg` as for `tensor_kind`."""
    tp, kind = len(pieces), tensor_kind(name, cfg)
    if tp == 1:
        return pieces[0]
    if kind == "qkv":
        return torch.cat(pieces, dim=0)  # whole groups per rank, ranks in group order
    if kind == "fc1":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "rowbias":
        if any(p.any() for p in pieces[1:]):
            raise ValueError(f"row-parallel bias {name} is non-zero beyond TP rank 0")
        return pieces[0]
    if kind == "replicated":
        if any(not torch.equal(pieces[0], p) for p in pieces[1:]):
            raise ValueError(f"replicated tensor {name} differs between TP ranks")
        return pieces[0]
    return torch.cat(pieces, dim=int(kind[3:]))


def reshard_piece(name: str, read, cfg: ModelConfig, src_tp: int, tp: int, rank: int) -> Tensor:
    """TP rank `rank` of `tp`'s piece of tensor `name`, from a split into `src_tp` pieces that
    `read(r)` returns one at a time. Reads only the pieces it needs: a run of src pieces when
    tp divides src_tp, one piece when src_tp divides tp, else all of them (merge, re-shard)."""
    if tensor_kind(name, cfg) == "replicated":
        return read(0)
    if src_tp % tp == 0:
        k = src_tp // tp
        return merge_tensor(name, [read(r) for r in range(rank * k, (rank + 1) * k)], cfg)
    if tp % src_tp == 0:
        k = tp // src_tp
        return shard_tensor(name, read(rank // k), shard_config(cfg, src_tp), k)[rank % k]
    full = merge_tensor(name, [read(r) for r in range(src_tp)], cfg)
    return shard_tensor(name, full, cfg, tp)[rank]


def shard_state(state: dict[str, Tensor], cfg: ModelConfig, tp: int) -> list[dict[str, Tensor]]:
    """Unsharded state dict -> one state dict per TP rank."""
    check_tp(cfg, tp)
    ranks: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, t in state.items():
        for r, piece in enumerate(shard_tensor(name, t, cfg, tp)):
            ranks[r][name] = piece
    return ranks


def merge_state(ranks: list[dict[str, Tensor]], cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    assert ranks and all(set(r) == set(ranks[0]) for r in ranks), "TP ranks hold different tensors"
    return {name: merge_tensor(name, [r[name] for r in ranks], cfg) for name in ranks[0]}
