"""Int8 PDM heads (engine/model/pdm_quant.py): bounded rounding, the same head after a round trip through
`spd convert head`, lossless decoding with it, clear errors for broken files."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts, reference, tiny_engine_config
from safetensors.torch import load_file, save_file

from spd_engine.engine.model.pdm import load_pdm, random_pdm, save_pdm
from spd_engine.engine.model.pdm_quant import SCALE_SUFFIX, dequantize_state, quantize_state
from spd_engine.engine.runtime.reference import ReferenceExecutor


def test_rounding_is_bounded_by_each_rows_largest_weight():
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 128, generator=g) * torch.linspace(0.01, 3.0, 64)[:, None],
             "norm": torch.rand(128, generator=g)}
    q = quantize_state(state)
    assert q["w"].dtype == torch.int8 and q["w" + SCALE_SUFFIX].shape == (64,) and q["norm"].dtype == torch.float16
    back = dequantize_state(q, torch.float32)
    assert set(back) == {"w", "norm"}
    err = (back["w"] - state["w"]).abs().amax(dim=1)
    bound = state["w"].abs().amax(dim=1) / 254 * 1.01 + 1e-3 * state["w"].abs().amax(dim=1)  # fp16 scale rounding
    assert bool((err <= bound).all())
    with pytest.raises(ValueError, match="per-row scales"):
        dequantize_state({"w": q["w"]}, torch.float32)


def test_int8_head_round_trip_and_lossless_decoding(tmp_path, one_thread):
    ecfg = tiny_engine_config("llama", 2)
    pdm = random_pdm(ecfg.model.cfg, tuple(ecfg.parallel.topology.stage_layers), num_layers=1, seed=3)
    save_pdm(pdm, tmp_path / "fp32")
    save_pdm(pdm, tmp_path / "int8", dtype=torch.int8)
    from spd_engine.tools.cli import main

    assert main(["convert", "head", str(tmp_path / "fp32"), str(tmp_path / "conv"), "--dtype", "int8"]) == 0
    a, b = (load_file(str(tmp_path / d / "pdm.safetensors")) for d in ("int8", "conv"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    stages = tuple(ecfg.parallel.topology.stage_layers)
    full, small = load_pdm(tmp_path / "fp32", ecfg.model.cfg, stages), load_pdm(tmp_path / "int8", ecfg.model.cfg, stages)
    for k, v in full.state_dict().items():
        assert torch.allclose(small.state_dict()[k], v, atol=v.abs().max().item() / 100 + 1e-6), k
    prompt = random_prompts(ecfg.model.cfg, (7,), seed=2)[0]
    with ReferenceExecutor(ecfg.replace(pdm=str(tmp_path / "int8"))) as ex:
        assert ex.generate(prompt, 24).tokens == reference(ecfg, prompt, 24)


def test_convert_head_refuses_what_is_not_a_head(tmp_path):
    from spd_engine.tools.cli import main

    assert main(["convert", "head", str(tmp_path / "none"), str(tmp_path / "out"), "--dtype", "int8"]) == 2
    ecfg = tiny_engine_config("llama", 2)
    save_pdm(random_pdm(ecfg.model.cfg, tuple(ecfg.parallel.topology.stage_layers)), tmp_path / "h", dtype=torch.int8)
    state = load_file(str(tmp_path / "h" / "pdm.safetensors"))
    save_file({k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}, str(tmp_path / "h" / "pdm.safetensors"))
    with pytest.raises(ValueError, match="per-row scales"):
        load_pdm(tmp_path / "h", ecfg.model.cfg, tuple(ecfg.parallel.topology.stage_layers))


def test_an_eagle_head_converts_and_loads_too(tmp_path):
    from spd_engine.engine.model.eagle_head import load_eagle, random_eagle, save_eagle
    from spd_engine.engine.model.pdm_quant import convert_head

    cfg = tiny_engine_config("llama", 2).model.cfg
    head = random_eagle(cfg, seed=1)
    save_eagle(head, tmp_path / "fp32")
    convert_head(tmp_path / "fp32", tmp_path / "int8", torch.int8)
    small = load_eagle(tmp_path / "int8", cfg)
    for k, v in head.state_dict().items():
        assert torch.allclose(small.state_dict()[k], v, atol=v.abs().max().item() / 100 + 1e-6), k
