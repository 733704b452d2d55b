"""Tensor-parallel pieces without processes: the shard plan (engine/model/tp_shard.py), the topology's
(stage, TP rank) <-> rank map, the serial TP oracle against the unsharded model (engine/model/tp_model.py),
and the threaded TP group running the real shards bit-identical to the serial oracle."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from spd_engine.engine.comm.tp_group import LocalTPHub, reduce_parts
from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.model.tp_model import SerialTP, resident_bytes
from spd_engine.engine.model.tp_shard import check_tp, merge_tensor, reshard_piece, shard_config, shard_tensor, vocab_range
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_stage_model, build_tp_stage_model
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime


def run_config(preset: str, **cfg_overrides) -> RunConfig:
    cfg = dataclasses.replace(PRESETS[preset], **cfg_overrides)
    return RunConfig(model=ModelSpec(source=f"random:{preset}", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1)), runtime=Runtime(capacity=64))


def test_check_tp_names_what_it_does_not_divide():
    smollm2 = PRESETS["smollm2-135m"]
    check_tp(smollm2, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3, num_heads=9"):
        check_tp(smollm2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        check_tp(smollm2, 0)


def test_shard_config_and_vocab_ranges_cover_the_model():
    cfg = tiny_config("llama")  # 4 heads, 2 KV heads, I=128, V=96
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 48)
    assert local.q_per_group == cfg.q_per_group
    assert [list(vocab_range(cfg, 2, r)) for r in range(2)] == [list(range(48)), list(range(48, 96))]


def test_qkv_shard_holds_whole_query_groups():
    cfg = tiny_config("llama", num_heads=4, num_kv_heads=2, head_dim=2)
    rows = torch.arange(cfg.qkv_rows, dtype=torch.float32)[:, None]  # row id as value
    group_rows = (cfg.q_per_group + 2) * cfg.head_dim
    pieces = shard_tensor("decoder.layers.0.self_attention.linear_qkv.weight", rows, cfg, 2)
    assert [p[:, 0].tolist() for p in pieces] == [list(range(0, group_rows)),
                                                  list(range(group_rows, 2 * group_rows))]


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1), (2, 4), (4, 2), (3, 1), (1, 3), (2, 3), (3, 2)])
def test_any_checkpoint_split_reshards_into_any_runtime_split(src, dst):
    cfg = tiny_config("llama", num_heads=12, num_kv_heads=12, intermediate_size=144, vocab_size=96, head_dim=4)
    names = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.self_attention.linear_proj.weight",
             "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight"]
    shapes = [(cfg.qkv_rows, 8), (2 * cfg.intermediate_size, 8), (8, cfg.intermediate_size),
              (8, cfg.num_heads * cfg.head_dim), (cfg.vocab_size, 8), (8,)]
    for name, shape in zip(names, shapes):
        full = torch.randn(shape)
        stored = shard_tensor(name, full, cfg, src)
        reads: list[int] = []

        def read(r: int) -> torch.Tensor:
            reads.append(r)
            return stored[r]

        got = [reshard_piece(name, read, cfg, src, dst, r) for r in range(dst)]
        assert all(torch.equal(g, w) for g, w in zip(got, shard_tensor(name, full, cfg, dst))), name
        assert torch.equal(merge_tensor(name, got), full)
        if src % dst == 0 or dst % src == 0 or "layernorm" in name:  # reads only the pieces it needs
            assert len(reads) == (dst if "layernorm" in name else max(src, dst)), (name, reads)


def test_topology_maps_stage_and_tp_rank_to_ranks_and_back():
    for colocate in (False, True):
        topo = Topology.build(6, 3, colocate=colocate, tp=2)
        base = 0 if colocate else 1
        assert topo.world_size == 6 + base
        assert topo.stage_ranks(1) == (base + 2, base + 3) and topo.stage_rank(1) == base + 2
        for rank in range(base, topo.world_size):
            stage, t = topo.place_of_rank(rank)
            assert topo.stage_rank(stage, t) == rank and topo.stage_of_rank(rank) == stage
        assert (topo.place_of_rank(0) is None) == (not colocate)
    with pytest.raises(ValueError, match="--tp"):
        Topology.build(6, 3, tp=0)


@pytest.mark.parametrize("preset,tp,overrides", [("tiny-llama", 2, {}), ("tiny-qwen2", 2, {"tie_embeddings": False}),
                                                 ("tiny-qwen3", 2, {}), ("smollm2-135m", 3, {"num_layers": 2})])
def test_serial_shards_equal_the_unsharded_model_within_float_tolerance(preset, tp, overrides):
    ecfg = run_config(preset, **overrides)
    L = ecfg.model.cfg.num_layers
    full = build_stage_model(ecfg, range(L), True, True)
    serial = SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), tp)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 8]])
    h, _ = full.forward_layers(full.embed(ids), full.new_cache(1, 16), 0)
    h_tp, _ = serial.forward_layers(serial.embed(ids), serial.new_cache(1, 16), 0)
    assert torch.equal(full.embed(ids), serial.embed(ids))  # masked rows + zeros: exact
    scale = h.abs().max()
    assert (h - h_tp).abs().max() <= 1e-5 * scale
    assert (full.logits(h) - serial.logits(h_tp)).abs().max() <= 1e-5 * full.logits(h).abs().max()
    whole = resident_bytes(full)
    for shard in serial.shards:  # every TP rank holds about 1/T (norms are replicated)
        assert abs(resident_bytes(shard) / whole - 1 / tp) < 0.01


def _threaded(shards_fn, tp: int):
    """Run shards_fn(group) -> result on tp threads sharing one LocalTPHub; results in rank order."""
    hub = LocalTPHub(range(tp), timeout_s=30.0)
    out, errors = [None] * tp, []

    def body(r: int) -> None:
        try:
            out[r] = shards_fn(hub.group(r))
        except BaseException as err:  # surfaced below, and the peers released
            errors.append(err)
            hub.group(r).abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    return out


def test_threaded_tp_group_gives_the_serial_oracle_bit_for_bit(one_thread):
    ecfg = run_config("tiny-llama", tie_embeddings=False)
    L, prompt, new = ecfg.model.cfg.num_layers, [3, 1, 4, 1, 5, 9, 2, 6], 12
    want = greedy_generate(SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), 2),
                           prompt, new)

    @torch.no_grad()
    def decode(group):
        model = build_tp_stage_model(ecfg, range(L), True, True, group)
        cache = model.new_cache(1, 32)
        h, _ = model.forward_layers(model.embed(torch.tensor([prompt])), cache, 0)
        out = []
        for pos in range(len(prompt), len(prompt) + new):
            out.append(model.choose_token(model.logits(h[0, -1]), SamplingParams(), pos))
            h, _ = model.forward_layers(model.embed(torch.tensor([[out[-1]]])), cache, pos)
        return out

    assert _threaded(decode, 2) == [want, want]


def test_reduce_parts_adds_in_rank_order():
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1e-3])
    assert reduce_parts([a, b, c]).item() == pytest.approx(1e-3) and reduce_parts([a, c, b]).item() == 0.0
