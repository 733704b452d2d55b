"""Builds a rank's parts (stage model, driver head, PDM) from an RunConfig.

Checkpoints are read tensor by tensor for the layers a rank owns only; random presets are
built from seeds by name, so every rank gets the same weights without any transfer.
"""
from __future__ import annotations

import torch

from spd_engine.engine.comm.tp_group import TPGroup
from spd_engine.engine.model.checkpoint import expected_shapes, load_stage_model, load_tp_stage_state, read_index
from spd_engine.engine.model.linear import set_weight_layout_
from spd_engine.engine.model.model import StageModel, init_random_, random_tensor
from spd_engine.engine.model.pdm import PDM, load_pdm, random_pdm
from spd_engine.engine.model.row_invariance import make_row_invariant_
from spd_engine.engine.model.tp_model import TPStageModel
from spd_engine.engine.model.tp_shard import shard_tensor
from spd_engine.engine.runtime.run_config import RunConfig, random_preset


def build_stage_model(ecfg: RunConfig, layers: range, embedding: bool, head: bool) -> StageModel:
    model = _load_stage_model(ecfg, layers, embedding, head)
    set_weight_layout(model, ecfg)
    if head and ecfg.model.head_screen:
        model.use_head_screen()  # stays off where unsupported (kernels/screened_argmax.py)
    return model


def _load_stage_model(ecfg: RunConfig, layers: range, embedding: bool, head: bool) -> StageModel:
    if random_preset(ecfg.model.source) is not None:
        model = StageModel(ecfg.model.cfg, layers, embedding=embedding, head=head, dtype=torch.float32)
        init_random_(model, seed=ecfg.runtime.seed)
        return model.to(device=ecfg.parallel.device, dtype=ecfg.model.torch_dtype).eval()
    if read_index(ecfg.model.source).tp > 1:  # a TP checkpoint: each tensor's pieces merged (engine/model/tp_shard.py)
        state = load_tp_stage_state(ecfg.model.source, layers, embedding, head, 1, 0, cfg=ecfg.model.cfg,
                                    dtype=ecfg.model.torch_dtype)
        model = StageModel(ecfg.model.cfg, layers, embedding=embedding, head=head, device="meta")
        model.load_state_dict(state, assign=True)
        return model.to(ecfg.parallel.device).eval()
    model = load_stage_model(ecfg.model.source, layers, embedding, head, device=ecfg.parallel.device,
                             dtype=ecfg.model.torch_dtype)
    return model.eval()


def build_tp_stage_model(ecfg: RunConfig, layers: range, embedding: bool, head: bool, group: TPGroup
                         ) -> TPStageModel:
    """One TP rank's shard of a stage, holding only its piece of every tensor: a random preset's
    weights are made tensor by tensor (the full model's, by name) and cut; a checkpoint of any TP
    split is read tensor by tensor and re-sharded where the splits differ."""
    cfg, tp, r = ecfg.model.cfg, group.size, group.rank
    if random_preset(ecfg.model.source) is not None:
        state = {name: shard_tensor(name, random_tensor(name, shape, cfg, ecfg.runtime.seed), cfg, tp)[r]
                 for name, shape in expected_shapes(cfg, layers, embedding, head).items()}
    else:
        state = load_tp_stage_state(ecfg.model.source, layers, embedding, head, tp, r, cfg=cfg)
    model = TPStageModel(cfg, layers, group, embedding=embedding, head=head, device="meta")
    model.load_state_dict({k: v.to(ecfg.model.torch_dtype) for k, v in state.items()}, assign=True)
    model = model.to(device=ecfg.parallel.device).eval()
    set_weight_layout(model, ecfg)
    return model


def set_weight_layout(model: StageModel, ecfg: RunConfig) -> None:
    """The run's weight layout (engine/model/linear.py) for the decoder layers; the output layer stays
    row-major (the int8 screen gathers its candidate rows, kernels/screened_argmax.py)."""
    skip = (model.output_layer,) if hasattr(model, "output_layer") else ()
    set_weight_layout_(model, ecfg.resolved_weight_layout, skip=skip)
    # the head's logits take one row per product instead (StageModel.logits_rows)
    model.row_invariance = make_row_invariant_(model, skip=skip)


def build_driver_head(ecfg: RunConfig) -> StageModel:
    """Embedding (anchor 0) + final norm + LM head: what the driver needs, no decoder layers."""
    return build_stage_model(ecfg, range(0, 0), embedding=True, head=True)


def build_pdm(ecfg: RunConfig) -> PDM:
    stage_layers = tuple(ecfg.parallel.topology.stage_layers)
    if ecfg.drafting.pdm == "random":
        pdm = random_pdm(ecfg.model.cfg, stage_layers, ecfg.drafting.pdm_layers, seed=ecfg.runtime.seed + 1,
                         anchors=ecfg.drafting.anchors)
    else:
        pdm = load_pdm(ecfg.drafting.pdm, ecfg.model.cfg, stage_layers)
    pdm = pdm.to(device=ecfg.parallel.device, dtype=ecfg.model.torch_dtype)
    if ecfg.pdm_int8:
        pdm.use_int8_matmuls()
    elif ecfg.pdm_torch_dtype != ecfg.model.torch_dtype:
        pdm.set_compute_dtype(ecfg.pdm_torch_dtype)
    # the PDM's anchor projections are read as weights (kernels/anchor_gather.py): never packed
    layout = ecfg.resolved_weight_layout
    set_weight_layout_(pdm, "col" if layout in ("packed", "mixed") else layout)
    pdm.make_row_invariant()
    return pdm.eval()
