"""What the check changes in the engine while it runs, and puts back: random presets' weights
drawn on the device (not on the CPU and copied), and a record of every step graph's mode."""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch


@torch.no_grad()
def _fill_random_(module: torch.nn.Module, seed: int, tied: bool) -> torch.nn.Module:
    """Random weights drawn on the module's device, each tensor from a generator seeded by its
    name (a stage's layers get the same weights as the full model's, a tied head its embedding):
    norms near 1, the rest std 0.02."""
    for name, p in module.named_parameters():
        key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.02 * noise)
    return module


@contextlib.contextmanager
def device_random_weights() -> Iterator[None]:
    """Random presets built on the run's device. The engine draws a random preset's weights on
    the CPU in fp32 and copies them over (engine/runtime/build.py): for a 4B shape that is minutes of CPU
    per executor, more than the GPU window holds. Inside this context the ranks' stages, the
    driver's head and the untrained PDM are made on the device instead, with the same rule for
    every executor (seeded by name), so an oracle and an SPD run still hold equal weights."""
    import spd_engine.engine.runtime.build as build_mod
    import spd_engine.engine.runtime.roles as roles_mod
    from spd_engine.engine.model.model import StageModel
    from spd_engine.engine.model.pdm import PDM, PDMConfig
    from spd_engine.engine.protocol.anchors import AnchorPlan
    from spd_engine.engine.protocol.topology import stage_bounds
    from spd_engine.engine.runtime.run_config import random_preset

    saved = (build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm)

    def stage(ecfg, layers: range, embedding: bool, head: bool):
        if random_preset(ecfg.model.source) is None:
            return saved[0](ecfg, layers, embedding, head)
        model = StageModel(ecfg.model.cfg, layers, embedding=embedding, head=head, device=ecfg.parallel.device,
                           dtype=ecfg.model.torch_dtype)
        return _fill_random_(model, ecfg.runtime.seed, ecfg.model.cfg.tie_embeddings).eval()

    def pdm(ecfg):
        if ecfg.drafting.pdm != "random":
            return saved[2](ecfg)
        layers = tuple(ecfg.parallel.topology.stage_layers)
        plan = AnchorPlan.build(stage_bounds(list(layers)), ecfg.drafting.anchors)
        pcfg = PDMConfig(layers, plan.anchors, ecfg.drafting.pdm_layers, None, ecfg.model.cfg.fingerprint())
        head = PDM(ecfg.model.cfg, pcfg, device=ecfg.parallel.device, dtype=ecfg.model.torch_dtype)
        return _fill_random_(head, ecfg.runtime.seed + 1, False).eval()

    build_mod.build_stage_model = roles_mod.build_stage_model = stage
    roles_mod.build_pdm = pdm
    try:
        yield
    finally:
        build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm = saved


@contextlib.contextmanager
def graph_modes() -> Iterator[list[str]]:
    """The mode of every step graph built inside (engine/model/graphs.py StepGraph): 'cuda graph', or the
    eager fallback with its reason. A graph run whose steps fell back must not pass as graphed."""
    from spd_engine.engine.model.graphs import StepGraph

    modes: list[str] = []
    original = StepGraph.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        modes.append(self.mode)

    StepGraph.__init__ = init
    try:
        yield modes
    finally:
        StepGraph.__init__ = original
