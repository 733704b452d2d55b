"""Compact head storage: int4 groups with fp16 scales (engine/model/head_int4.py) and the zlib form of a
weights file (engine/model/head_zlib.py); both load through the usual head readers, and the int8 and
float forms already in the tree still load."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spd_engine.engine.model.head_int4 import GROUP, Q4_SCALE_SUFFIX, dequantize_int4, quantize_int4, quantize_state_int4
from spd_engine.engine.model.head_zlib import compressed_path, load_weights
from spd_engine.engine.model.pdm import load_pdm, random_pdm, save_pdm
from spd_engine.engine.model.pdm_quant import MIN_NUMEL, convert_head, dequantize_state
from spd_engine.engine.runtime.run_config import PRESETS


def test_int4_codes_round_trip_exactly_and_pack_two_per_byte() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, cols = 6, 4 * GROUP
    codes = torch.randint(-7, 8, (rows, cols), generator=gen).float()
    codes[:, ::GROUP] = 7  # every group reaches +7: its unclipped scale is then exactly `s`
    s = (torch.rand(rows, cols // GROUP, generator=gen) + 0.5).half().float()  # fp16-exact scales
    w = codes * s.repeat_interleave(GROUP, dim=1)
    packed, scale = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, cols // 2)
    assert scale.dtype == torch.float16 and scale.shape == (rows, cols // GROUP)
    assert torch.equal(dequantize_int4(packed, scale, torch.float32), w)


def test_int4_error_is_bounded_by_half_a_step_where_nothing_clips() -> None:
    w = torch.randn(64, 8 * GROUP, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_int4(w)
    back = dequantize_int4(packed, scale, torch.float32)
    step = scale.float().repeat_interleave(GROUP, dim=1)
    inside = w.abs() <= 7 * step  # not clipped by a smaller chosen scale
    assert ((back - w).abs()[inside] <= step[inside] / 2 + 1e-6).all()
    assert ((back - w).norm() / w.norm()) < 0.12  # 4 bits: about a tenth of the weights' norm


def test_int4_refuses_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="groups of"):
        quantize_int4(torch.randn(4, GROUP + 1))
    packed, scale = quantize_int4(torch.randn(4, 2 * GROUP))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_int4(packed, scale[:2], torch.float32)
    state = quantize_state_int4({"w": torch.randn(128, 2 * GROUP), "odd": torch.randn(128, 33)}, 64)
    assert state["w"].dtype == torch.uint8 and state["odd"].dtype == torch.float16  # odd width: fp16
    del state["w" + Q4_SCALE_SUFFIX]
    with pytest.raises(ValueError, match="lacks its group scales"):
        dequantize_state(state, torch.float32)


def _pdm_dir(tmp_path: Path) -> tuple[Path, object, tuple[int, ...]]:
    cfg = PRESETS["tiny-llama"]
    layers = (3, 3)
    pdm = random_pdm(cfg, layers, 1, seed=3)
    save_pdm(pdm, tmp_path / "fp32")
    return tmp_path / "fp32", cfg, layers


def test_convert_head_to_int4_and_zlib_loads_back(tmp_path: Path) -> None:
    src, cfg, layers = _pdm_dir(tmp_path)
    want = load_pdm(src, cfg, layers).state_dict()
    convert_head(src, tmp_path / "int4", "int4")
    stored = load_file(str(tmp_path / "int4" / "pdm.safetensors"))
    assert any(t.dtype == torch.uint8 for t in stored.values())
    got = load_pdm(tmp_path / "int4", cfg, layers).state_dict()
    for k, v in want.items():
        if v.dim() == 2 and v.numel() >= MIN_NUMEL and v.shape[1] % GROUP == 0:
            assert 0 < (got[k] - v).norm() / v.norm() < 0.15, k  # quantized, within 4-bit error
        else:
            assert torch.allclose(got[k], v.half().float()), k  # fp16 like the int8 format's vectors
    # int8 + zlib: the same tensors as int8 alone, bit for bit; the plain file is gone
    convert_head(src, tmp_path / "int8", torch.int8)
    convert_head(tmp_path / "int8", tmp_path / "int8z", torch.int8, compress=True)
    assert not (tmp_path / "int8z" / "pdm.safetensors").exists()
    assert compressed_path(tmp_path / "int8z" / "pdm.safetensors").is_file()
    plain = load_file(str(tmp_path / "int8" / "pdm.safetensors"))
    packed = load_weights(tmp_path / "int8z" / "pdm.safetensors")
    assert plain.keys() == packed.keys() and all(torch.equal(plain[k], packed[k]) for k in plain)
    a = load_pdm(tmp_path / "int8", cfg, layers).state_dict()
    b = load_pdm(tmp_path / "int8z", cfg, layers).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and a zlib head converts on (reads either form)
    convert_head(tmp_path / "int8z", tmp_path / "again", "int4")
    assert (tmp_path / "again" / "pdm.safetensors").is_file()


def test_corrupt_or_missing_compressed_weights_are_clear_errors(tmp_path: Path) -> None:
    src, cfg, layers = _pdm_dir(tmp_path)
    convert_head(src, tmp_path / "z", torch.int8, compress=True)
    z = compressed_path(tmp_path / "z" / "pdm.safetensors")
    z.write_bytes(b"not zlib")
    with pytest.raises(ValueError, match="corrupt compressed weights"):
        load_pdm(tmp_path / "z", cfg, layers)
    z.unlink()
    with pytest.raises(ValueError, match="weights missing"):
        load_pdm(tmp_path / "z", cfg, layers)
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    assert torch.equal(load_weights(tmp_path / "plain.safetensors")["x"], torch.zeros(2))
