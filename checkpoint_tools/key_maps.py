"""HF <-> Megatron-core key maps and tensor-parallel sharding. Pure tensor logic, no torch.distributed.

One declarative table (`RULES`) says which HF tensors make which Megatron tensor and how (identity,
QKV fused per query group, gate stacked on up). `hf_to_mcore` reads it forwards, `mcore_to_hf`
backwards, so the two directions cannot drift apart.

Megatron fused layouts (the engine's `StageModel` uses them as well):
  linear_qkv [(nh + 2 nkv) hd, H]: for each KV head g: its q_per_group q heads, then k_g, then v_g
  linear_fc1 [2 I, H]: gate rows, then up rows (its bias likewise); a GeLU MLP's [I, H] is one
      projection (HF-style name up_proj)
  a LayerNorm model's norm biases sit next to their weights (HF-style names `<norm>.bias`)

Tensor parallelism (Megatron's scheme; engine/model/tp_shard.py, which the runtime shares):
  column-parallel linear_qkv: each rank gets whole query groups (its q heads with their k and v);
      tp must divide num_kv_heads and num_heads
  column-parallel linear_fc1: rank r holds its gate shard stacked on its up shard (splitting the
      fused tensor in tp equal pieces would hand rank 0 only gate rows)
  row-parallel linear_proj, linear_fc2: split on dim 1
  vocab-parallel embedding / output layer: split on dim 0; the vocabulary must be divisible by tp
      (no padding, so a round trip stays bit-identical)
  norms: replicated
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from spd_engine.engine.model import tp_shard
from spd_engine.engine.model.model_config import ModelConfig

Tensor = torch.Tensor
LAYER = "{i}"  # placeholder for the global layer index in key patterns


# ---- fuse / split transforms (inverse pairs) ----

def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """q [nh hd, ...], k, v [nkv hd, ...] -> [(nh + 2 nkv) hd, ...] grouped per KV head."""
    g, hd, rest = cfg.num_kv_heads, cfg.head_dim, q.shape[1:]
    q = q.reshape(g, cfg.q_per_group * hd, *rest)
    return torch.cat([q, k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, cfg: ModelConfig, groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`; `groups` KV heads (default all: a TP shard holds fewer)."""
    g, hd, qpg, rest = groups or cfg.num_kv_heads, cfg.head_dim, cfg.q_per_group, qkv.shape[1:]
    grouped = qkv.reshape(g, (qpg + 2) * hd, *rest)
    q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gate_up(gate: Tensor, up: Tensor, cfg: ModelConfig) -> Tensor:
    """gate, up [I, H] -> fc1 [2I, H]."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def _identity(t: Tensor, cfg: ModelConfig) -> Tensor:
    return t


def _identity_split(t: Tensor, cfg: ModelConfig) -> tuple[Tensor]:
    return (t,)


@dataclass(frozen=True)
class Transform:
    fuse: Callable[..., Tensor]  # (*hf tensors, cfg) -> mcore tensor
    split: Callable[[Tensor, ModelConfig], tuple[Tensor, ...]]  # mcore tensor -> hf tensors


IDENTITY = Transform(_identity, _identity_split)
QKV = Transform(fuse_qkv, split_qkv)
GATE_UP = Transform(fuse_gate_up, split_gate_up)


def _always(cfg: ModelConfig) -> bool:
    return True


def _norm_bias(cfg: ModelConfig) -> bool:
    return cfg.norm == "layernorm"


@dataclass(frozen=True)
class Rule:
    """HF key patterns (in fuse order) <-> one Megatron key pattern, present when `when(cfg)`."""

    hf: tuple[str, ...]
    mcore: str
    transform: Transform = IDENTITY
    when: Callable[[ModelConfig], bool] = _always

    @property
    def per_layer(self) -> bool:
        return LAYER in self.mcore


_A = "model.layers.{i}.self_attn."
_M = "decoder.layers.{i}.self_attention."
RULES: tuple[Rule, ...] = (
    Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight"),
    Rule(("model.layers.{i}.input_layernorm.weight",), "decoder.layers.{i}.input_layernorm.weight"),
    Rule((_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), _M + "linear_qkv.weight", QKV),
    Rule((_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), _M + "linear_qkv.bias", QKV,
         lambda c: c.qkv_bias),
    Rule(("model.layers.{i}.input_layernorm.bias",), "decoder.layers.{i}.input_layernorm.bias", when=_norm_bias),
    Rule((_A + "q_norm.weight",), _M + "q_layernorm.weight", when=lambda c: c.qk_norm),
    Rule((_A + "q_norm.bias",), _M + "q_layernorm.bias", when=lambda c: c.qk_norm and _norm_bias(c)),
    Rule((_A + "k_norm.weight",), _M + "k_layernorm.weight", when=lambda c: c.qk_norm),
    Rule((_A + "k_norm.bias",), _M + "k_layernorm.bias", when=lambda c: c.qk_norm and _norm_bias(c)),
    Rule((_A + "o_proj.weight",), _M + "linear_proj.weight"),
    Rule((_A + "o_proj.bias",), _M + "linear_proj.bias", when=lambda c: c.linear_bias),
    Rule(("model.layers.{i}.post_attention_layernorm.weight",), "decoder.layers.{i}.pre_mlp_layernorm.weight"),
    Rule(("model.layers.{i}.post_attention_layernorm.bias",), "decoder.layers.{i}.pre_mlp_layernorm.bias",
         when=_norm_bias),
    Rule(("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
         "decoder.layers.{i}.mlp.linear_fc1.weight", GATE_UP, lambda c: c.gated),
    Rule(("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
         "decoder.layers.{i}.mlp.linear_fc1.bias", GATE_UP, lambda c: c.gated and c.linear_bias),
    Rule(("model.layers.{i}.mlp.up_proj.weight",), "decoder.layers.{i}.mlp.linear_fc1.weight",
         when=lambda c: not c.gated),
    Rule(("model.layers.{i}.mlp.up_proj.bias",), "decoder.layers.{i}.mlp.linear_fc1.bias",
         when=lambda c: not c.gated and c.linear_bias),
    Rule(("model.layers.{i}.mlp.down_proj.weight",), "decoder.layers.{i}.mlp.linear_fc2.weight"),
    Rule(("model.layers.{i}.mlp.down_proj.bias",), "decoder.layers.{i}.mlp.linear_fc2.bias",
         when=lambda c: c.linear_bias),
    Rule(("model.norm.weight",), "decoder.final_layernorm.weight"),
    Rule(("model.norm.bias",), "decoder.final_layernorm.bias", when=_norm_bias),
    Rule(("lm_head.weight",), "output_layer.weight", when=lambda c: not c.tie_embeddings),
)
# HF tensors that carry no weights of their own (old checkpoints store RoPE tables).
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _expand(cfg: ModelConfig) -> Iterator[tuple[Rule, tuple[str, ...], str]]:
    """Every (rule, concrete HF keys, concrete Megatron key) of this model."""
    for rule in RULES:
        if not rule.when(cfg):
            continue
        for i in range(cfg.num_layers) if rule.per_layer else [None]:
            fill = (lambda s: s.replace(LAYER, str(i))) if i is not None else (lambda s: s)
            yield rule, tuple(fill(k) for k in rule.hf), fill(rule.mcore)


def hf_keys(cfg: ModelConfig) -> list[str]:
    return [k for _, hf, _ in _expand(cfg) for k in hf]


def mcore_keys(cfg: ModelConfig) -> list[str]:
    return [m for _, _, m in _expand(cfg)]


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> the shape the config gives it: the model's own tensors (meta device) split by `RULES`."""
    from spd_engine.engine.model.checkpoint import expected_shapes

    mcore = expected_shapes(cfg, range(cfg.num_layers), True, True)
    shapes = {}
    for rule, keys, mkey in _expand(cfg):
        parts = rule.transform.split(torch.empty(mcore[mkey], device="meta"), cfg)
        shapes.update({k: tuple(p.shape) for k, p in zip(keys, parts)})
    return shapes


def _shape_fields(cfg: ModelConfig) -> str:
    return (f"hidden_size {cfg.hidden_size}, {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads of head_dim "
            f"{cfg.head_dim}, intermediate_size {cfg.intermediate_size}, vocab_size {cfg.vocab_size}")


def hf_to_mcore(hf: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF state dict -> Megatron/engine state dict (unsharded). Unknown or missing keys are errors."""
    hf = dict(hf)
    if cfg.tie_embeddings and "lm_head.weight" in hf:
        # Some tied checkpoints still store the head; HF ties it to the embedding on load, so do we.
        hf.pop("lm_head.weight")
    out, used = {}, set()
    missing = [k for k in hf_keys(cfg) if k not in hf]
    if missing:
        raise ValueError(f"HF checkpoint lacks {len(missing)} tensors the {cfg.arch} config needs, "
                         f"e.g. {missing[:4]}")
    want = expected_hf_shapes(cfg)
    for rule, keys, mkey in _expand(cfg):
        for k in keys:
            if tuple(hf[k].shape) != want[k]:  # before fusing: a wrong head_dim would fail inside a reshape
                raise ValueError(f"HF tensor {k} has shape {tuple(hf[k].shape)}, but the config needs {want[k]} "
                                 f"({_shape_fields(cfg)}): the config does not describe these weights")
        out[mkey] = rule.transform.fuse(*(hf[k] for k in keys), cfg)
        used.update(keys)
    extra = sorted(k for k in hf if k not in used and not _IGNORED_HF.search(k))
    if extra:
        raise ValueError(f"HF checkpoint has {len(extra)} tensors this {cfg.arch} config does not use, "
                         f"e.g. {extra[:4]} (unsupported architecture variant?)")
    return out


def mcore_to_hf(mcore: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of `hf_to_mcore` (unsharded); split outputs are made contiguous for safetensors."""
    expected = mcore_keys(cfg)
    problems = sorted(set(expected) ^ set(mcore))
    if problems:
        raise ValueError(f"Megatron state dict does not match the {cfg.arch} config: {problems[:4]} "
                         "missing or unexpected")
    out = {}
    for rule, keys, mkey in _expand(cfg):
        parts = rule.transform.split(mcore[mkey], cfg)
        assert len(parts) == len(keys), (mkey, len(parts), keys)
        out.update({k: p.contiguous() for k, p in zip(keys, parts)})
    return out


# ---- tensor parallelism: the engine's own sharding (engine/model/tp_shard.py), re-exported here ----

check_tp, shard_tensor, merge_tensor = tp_shard.check_tp, tp_shard.shard_tensor, tp_shard.merge_tensor
shard_state, merge_state = tp_shard.shard_state, tp_shard.merge_state


# ---- Megatron torch_dist naming: TE-style norm names, layers stacked on a leading dim ----

# Megatron's local layer spec maps its norm names to the Transformer-Engine ones in checkpoints
# (TE fuses each norm into the following linear), so both specs read the same files.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def to_dist_key(name: str) -> tuple[str, int | None]:
    """Engine name -> (torch_dist key, layer index along the stacked dim or None)."""
    m = _LAYER_KEY.match(name)
    if not m:
        return name, None
    suffix = TE_NAMES.get(m.group(2), m.group(2))
    return f"decoder.layers.{suffix}", int(m.group(1))


def from_dist_key(key: str, layer: int | None) -> str:
    """Inverse of `to_dist_key`."""
    if layer is None:
        return key
    assert key.startswith("decoder.layers."), key
    suffix = key[len("decoder.layers."):]
    local = {te: local for local, te in TE_NAMES.items()}.get(suffix, suffix)
    return f"decoder.layers.{layer}.{local}"


def extra_state_keys() -> list[str]:
    """Per-layer `_extra_state` objects Megatron's linear layers save (stacked keys)."""
    return [f"decoder.layers.{m}._extra_state" for m in
            ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
