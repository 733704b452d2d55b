"""Builds a rank's parts (stage model, driver head, PDM) from an RunConfig.

Checkpoints are read tensor by tensor for the layers a rank owns only; random presets are
built from seeds by name, so every rank gets the same weights without any transfer.
"""
from __future__ import annotations

import torch

from spd_engine.engine.checkpoint import load_stage_model
from spd_engine.engine.run_config import RunConfig, random_preset
from spd_engine.engine.model import StageModel, init_random_
from spd_engine.engine.pdm import PDM, load_pdm, random_pdm


def build_stage_model(ecfg: RunConfig, layers: range, embedding: bool, head: bool) -> StageModel:
    if random_preset(ecfg.model) is not None:
        model = StageModel(ecfg.cfg, layers, embedding=embedding, head=head, dtype=torch.float32)
        init_random_(model, seed=ecfg.seed)
        return model.to(device=ecfg.device, dtype=ecfg.torch_dtype).eval()
    model = load_stage_model(ecfg.model, layers, embedding, head, device=ecfg.device, dtype=ecfg.torch_dtype)
    return model.eval()


def build_driver_head(ecfg: RunConfig) -> StageModel:
    """Embedding (anchor 0) + final norm + LM head: what the driver needs, no decoder layers."""
    return build_stage_model(ecfg, range(0, 0), embedding=True, head=True)


def build_pdm(ecfg: RunConfig) -> PDM:
    stage_layers = tuple(ecfg.topology.stage_layers)
    if ecfg.pdm == "random":
        pdm = random_pdm(ecfg.cfg, stage_layers, ecfg.pdm_layers, seed=ecfg.seed + 1, anchors=ecfg.anchors)
    else:
        pdm = load_pdm(ecfg.pdm, ecfg.cfg, stage_layers)
    return pdm.to(device=ecfg.device, dtype=ecfg.torch_dtype).eval()
