"""Int8 storage of a head's weights (PDM or eagle): per-output-row absmax scales, dequantized when loaded.

A shipped head lives in the repository and the package, where its size counts: the n=4 head is
30 MB in fp16, and an n=8 head's anchor projections make it larger. Every matrix of at least
`MIN_NUMEL` elements is stored as int8 rows `q = round(w / s)`, `s = max|w_row| / 127`, with its
scales beside it (`<name>.qscale`, fp16); vectors (norms) and small tensors stay fp16. Loading
gives `q * s` in the run's dtype: a relative error of at most 1/254 of each row's largest
weight. Whether that costs acceptance is measured, not assumed (docs/training.md).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

SCALE_SUFFIX = ".qscale"
MIN_NUMEL = 4096


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp weights -> int8 rows + fp16 scales for matrices; other tensors as fp16."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        assert not name.endswith(SCALE_SUFFIX), f"{name}: a tensor name may not end in {SCALE_SUFFIX}"
        w = w.detach().float().cpu()
        if w.dim() != 2 or w.numel() < MIN_NUMEL:
            out[name] = w.half().contiguous()
            continue
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)  # [rows, 1]
        out[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.squeeze(1).half().contiguous()
    return out


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The inverse: int8 rows times their scales, int4 groups times theirs (engine/model/head_int4.py);
    a state without quantized tensors passes unchanged."""
    from spd_engine.engine.model.head_int4 import Q4_SCALE_SUFFIX, dequantize_int4

    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX) or name.endswith(Q4_SCALE_SUFFIX):
            continue
        if t.dtype == torch.uint8:  # int4 codes in pairs (engine/model/head_int4.py)
            scale = state.get(name + Q4_SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"int4 PDM tensor {name} lacks its group scales {name + Q4_SCALE_SUFFIX}")
            out[name] = dequantize_int4(t, scale, dtype)
        elif t.dtype == torch.int8:
            scale = state.get(name + SCALE_SUFFIX)
            if scale is None or scale.shape != (t.shape[0],):
                raise ValueError(f"int8 PDM tensor {name} lacks its per-row scales {name + SCALE_SUFFIX}")
            out[name] = (t.float() * scale.float()[:, None]).to(dtype)
        else:
            out[name] = t
    return out


def convert_head(src: Path, dst: Path, dtype: torch.dtype | str, compress: bool = False) -> Path:
    """Re-store a head directory's weights as `dtype` (torch.int8: int8 rows + scales; "int4": int4
    groups + scales, engine/model/head_int4.py): a PDM head
    (pdm.json + pdm.safetensors) or an eagle head (eagle.json + eagle.safetensors); the config and
    the other files (train_history.json, ...) are copied unchanged. `compress`: the weights file
    as its zlib form (engine/model/head_zlib.py: the same bytes, smaller); either form is read."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from spd_engine.engine.model.head_zlib import ZLIB_SUFFIX, compress_weights, load_weights, weights_exist

    src, dst = Path(src), Path(dst)
    kind = next((k for k in ("pdm", "eagle") if (src / f"{k}.json").is_file() and
                 weights_exist(src / f"{k}.safetensors")), None)
    if kind is None:
        raise ValueError(f"no PDM or eagle head at {src} (pdm.json + pdm.safetensors, or eagle.json + eagle.safetensors)")
    wpath = src / f"{kind}.safetensors"
    if dst.resolve() == src.resolve():
        raise ValueError("convert a head into another directory")
    try:
        state = dequantize_state(load_weights(wpath), torch.float32)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"corrupt PDM weights {wpath}: {err}") from None
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in (wpath.name, wpath.name + ZLIB_SUFFIX):
            shutil.copyfile(f, dst / f.name)
    if dtype == "int4":
        from spd_engine.engine.model.head_int4 import quantize_state_int4
        out = quantize_state_int4(state, MIN_NUMEL)
    elif dtype == torch.int8:
        out = quantize_state(state)
    elif isinstance(dtype, torch.dtype):
        out = {k: v.to(dtype).contiguous() for k, v in state.items()}
    else:
        raise ValueError(f"unknown head dtype {dtype!r}: int4, int8 or a float dtype")
    save_file(out, str(dst / wpath.name))
    if compress:
        compress_weights(dst / wpath.name)
    return dst
