"""Key maps: HF <-> Megatron transforms and tensor-parallel sharding, checked by what the tensors compute."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_helpers import ARCHS, tiny_state

from spd_engine.checkpoint_tools import key_maps
from spd_engine.engine.model.kv_cache import KVCache
from spd_engine.engine.model.model import MLP, SelfAttention, causal_mask, rope_tables
from spd_engine.engine.model.model_config import tiny_config

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_mcore_round_trip_is_bit_identical(arch):
    cfg = tiny_config(arch)
    state = tiny_state(cfg)
    hf = key_maps.mcore_to_hf(state, cfg)
    assert set(hf) == set(key_maps.hf_keys(cfg))
    back = key_maps.hf_to_mcore(hf, cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_qkv_fused_per_query_group():
    cfg = tiny_config("llama", num_heads=6, num_kv_heads=2, head_dim=4)  # 3 q heads per group
    hd, H = cfg.head_dim, cfg.hidden_size
    # Row r of head j of q/k/v carries a unique tag, so the fused row order can be read back.
    q = torch.stack([torch.full((H,), 100.0 + j) for j in range(cfg.num_heads) for _ in range(hd)])
    k = torch.stack([torch.full((H,), 200.0 + g) for g in range(cfg.num_kv_heads) for _ in range(hd)])
    v = torch.stack([torch.full((H,), 300.0 + g) for g in range(cfg.num_kv_heads) for _ in range(hd)])
    fused = key_maps.fuse_qkv(q, k, v, cfg)[::hd, 0].tolist()  # one tag per head block
    assert fused == [100, 101, 102, 200, 300, 103, 104, 105, 201, 301]
    assert all(torch.equal(a, b) for a, b in zip(key_maps.split_qkv(key_maps.fuse_qkv(q, k, v, cfg), cfg), (q, k, v)))


def test_hf_to_mcore_rejects_missing_and_unknown_tensors():
    cfg = tiny_config("qwen2")
    hf = key_maps.mcore_to_hf(tiny_state(cfg), cfg)
    missing = {k: v for k, v in hf.items() if k != "model.layers.3.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        key_maps.hf_to_mcore(missing, cfg)
    with pytest.raises(ValueError, match="does not use.*o_proj.bias"):
        key_maps.hf_to_mcore({**hf, "model.layers.0.self_attn.o_proj.bias": torch.zeros(4)}, cfg)
    # RoPE tables of old checkpoints and the redundant head of a tied model are not weights.
    extra = {**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8), "lm_head.weight": torch.zeros(1)}
    assert set(key_maps.hf_to_mcore(extra, cfg)) == set(key_maps.mcore_keys(cfg))


def test_check_tp_needs_whole_query_groups():
    smollm2_like = tiny_config("llama", num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=72,
                               intermediate_size=192, vocab_size=96)
    key_maps.check_tp(smollm2_like, 3)
    with pytest.raises(ValueError, match=r"--tp 2 does not divide num_kv_heads=3, num_heads=9"):
        key_maps.check_tp(smollm2_like, 2)
    with pytest.raises(ValueError, match="vocab_size=97"):
        key_maps.check_tp(dataclasses.replace(smollm2_like, vocab_size=97), 3)
    with pytest.raises(ValueError, match=">= 1"):
        key_maps.check_tp(smollm2_like, 0)


def _local_cfg(cfg, tp):
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def _attention(cfg, weights, x):
    """Self-attention output [B, T, H] of one layer (layer 0) with the given weights."""
    attn = SelfAttention(cfg)
    attn.load_state_dict({k.removeprefix("decoder.layers.0.self_attention."): v for k, v in weights.items()})
    B, T, _ = x.shape
    cos, sin = (t[:T].expand(B, T, -1) for t in rope_tables(cfg, x.device))
    with torch.no_grad():
        return attn(x, 0, KVCache(cfg, range(1), B, T), 0, cos, sin, causal_mask(0, T, x.device))


def _mlp(cfg, weights, x):
    mlp = MLP(cfg)
    mlp.load_state_dict({k.removeprefix("decoder.layers.0.mlp."): v for k, v in weights.items()})
    with torch.no_grad():
        return mlp(x)


def _layer0(state, part):
    return {k: v for k, v in state.items() if k.startswith(f"decoder.layers.0.{part}")}


@pytest.mark.parametrize("arch,heads,groups,tp", [("qwen2", 4, 2, 2), ("llama", 6, 3, 3), ("qwen3", 8, 4, 2)])
def test_tp_shards_compute_the_unsharded_layer(arch, heads, groups, tp):
    """Column-parallel qkv/fc1 then row-parallel proj/fc2: the partial outputs sum to the full output."""
    cfg = tiny_config(arch, num_heads=heads, num_kv_heads=groups, head_dim=8, hidden_size=48, intermediate_size=96)
    state = tiny_state(cfg)
    x = torch.randn(2, 5, cfg.hidden_size)
    local = _local_cfg(cfg, tp)
    for part, run in (("self_attention", _attention), ("mlp", _mlp)):
        weights = _layer0(state, part)
        full = run(cfg, weights, x)
        ranks = key_maps.shard_state(weights, cfg, tp)
        partial = sum(run(local, ranks[r], x) for r in range(tp))
        torch.testing.assert_close(partial, full, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in
                   zip(key_maps.merge_state(ranks, cfg).values(), weights.values()))


def test_naive_fc1_split_is_not_a_tp_shard():
    """Cutting the fused [gate; up] tensor in tp pieces would give rank 0 only gate rows."""
    cfg = tiny_config("llama")
    fc1 = _layer0(tiny_state(cfg), "mlp.linear_fc1")["decoder.layers.0.mlp.linear_fc1.weight"]
    shards = key_maps.shard_tensor("decoder.layers.0.mlp.linear_fc1.weight", fc1, cfg, 2)
    gate, up = fc1.chunk(2)
    assert torch.equal(shards[0], torch.cat([gate.chunk(2)[0], up.chunk(2)[0]]))
    assert not torch.equal(shards[0], fc1.chunk(2)[0])


def test_vocab_parallel_logits_concatenate():
    cfg = tiny_config("llama")
    state = tiny_state(cfg)
    h = torch.randn(3, cfg.hidden_size)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        pieces = key_maps.shard_tensor(name, state[name], cfg, 4)
        assert [p.shape[0] for p in pieces] == [cfg.vocab_size // 4] * 4
        torch.testing.assert_close(torch.cat([h @ p.T for p in pieces], -1), h @ state[name].T)


def test_norms_are_replicated_and_must_agree():
    cfg = tiny_config("qwen3")
    name = "decoder.layers.1.self_attention.q_layernorm.weight"
    t = tiny_state(cfg)[name]
    pieces = key_maps.shard_tensor(name, t, cfg, 2)
    assert all(torch.equal(p, t) for p in pieces)
    with pytest.raises(ValueError, match="differs between TP ranks"):
        key_maps.merge_tensor(name, [t, t + 1], cfg)


def test_dist_keys_use_te_norm_names_and_invert():
    cases = {
        "decoder.layers.7.input_layernorm.weight": ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 7),
        "decoder.layers.0.pre_mlp_layernorm.weight": ("decoder.layers.mlp.linear_fc1.layer_norm_weight", 0),
        "decoder.layers.3.mlp.linear_fc2.weight": ("decoder.layers.mlp.linear_fc2.weight", 3),
        "decoder.final_layernorm.weight": ("decoder.final_layernorm.weight", None),
    }
    for name, expected in cases.items():
        assert key_maps.to_dist_key(name) == expected
        assert key_maps.from_dist_key(*expected) == name
