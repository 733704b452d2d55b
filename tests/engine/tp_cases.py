"""Shared pieces of the tensor-parallel runtime tests: run configs with --tp, and the greedy
oracle with the same TP split (engine/model/tp_model.py SerialTP: the T shards in one thread, partial
sums added in the all-reduce's order), with the head the run uses (vocab-parallel for tp / pp,
the driver's unsharded head for SPD)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from helpers import tiny_cfg, tiny_engine_config

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.tp_model import SerialTP
from spd_engine.engine.runtime.build import build_driver_head, build_tp_stage_model
from spd_engine.engine.runtime.run_config import RunConfig


def tp_cfg(tp: int, **overrides):
    """tiny-llama (untied) with head counts T divides: 4 heads / 2 KV heads for T=2, 6 / 3 for T=3."""
    if tp == 3:
        overrides = dict(num_heads=6, num_kv_heads=3, intermediate_size=192, **overrides)
    return tiny_cfg("llama", **overrides)


def tp_engine_config(mode: str, n: int, tp: int, colocate: bool = False, **kw) -> RunConfig:
    cfg = kw.pop("cfg", None) or tp_cfg(tp)
    ecfg = tiny_engine_config("llama", n, colocate=colocate, mode=mode, cfg=cfg, **kw)
    return ecfg.replace(topology=dataclasses.replace(ecfg.parallel.topology, tp=tp))


_ORACLES: dict[tuple, SerialTP] = {}


def serial_tp(ecfg: RunConfig) -> SerialTP:
    """The whole model as the run's TP split, with the head the run's mode uses."""
    key = (ecfg.model.source, ecfg.model.cfg.fingerprint(), ecfg.runtime.seed, ecfg.parallel.topology.tp, ecfg.mode == "spd")
    if key not in _ORACLES:
        L = ecfg.model.cfg.num_layers
        head = build_driver_head(ecfg) if ecfg.mode == "spd" else None
        _ORACLES[key] = SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g),
                                       ecfg.parallel.topology.tp, head)
    return _ORACLES[key]


def tp_reference(ecfg: RunConfig, prompt: Sequence[int], max_new: int, eos: Sequence[int] = ()) -> list[int]:
    """Greedy decoding with the run's TP split (same prefill chunk and intra-op threads as its ranks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(ecfg.parallel.threads or before)
    try:
        return greedy_generate(serial_tp(ecfg), prompt, max_new, eos_ids=eos, chunk=ecfg.runtime.prefill_chunk)
    finally:
        torch.set_num_threads(before)
