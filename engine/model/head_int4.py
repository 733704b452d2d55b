"""Int4 storage of a head's weights: groups of `GROUP` weights along a row share one fp16 scale.

The shipped heads travel with the repository, whose tracked size has a budget (tests/test_repo_size.py).
An int8 matrix (engine/model/pdm_quant.py) costs one byte a weight; here two 4-bit codes share a byte
and every group of 32 weights of a row adds a 2-byte scale: 0.5625 bytes a weight. Codes are
`q = clamp(round(w / s), -8, 7)` stored as `q + 8` (low nibble: the even column, high nibble:
the odd one); the scale of each group is chosen among a few clipping levels of `max|w| / 7` as
the one with the smallest squared error, since a slightly clipped scale often wins on groups with
one outlier. A matrix is `<name>` (uint8, `[rows, cols / 2]`) beside `<name>.q4scale`
(fp16, `[rows, cols / GROUP]`); the group size follows from the two shapes. Whether a head may be
stored so is decided by measured acceptance (docs/gpu-check.md, "Repository size").
"""
from __future__ import annotations

import torch

Q4_SCALE_SUFFIX = ".q4scale"
GROUP = 32
# fractions of max|w| / 7 tried as a group's scale (1.0 first: ties keep the unclipped scale)
CLIP_LEVELS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def can_quantize(w: torch.Tensor, min_numel: int) -> bool:
    """A matrix of at least `min_numel` weights whose rows split into whole groups."""
    return w.dim() == 2 and w.numel() >= min_numel and w.shape[1] % GROUP == 0


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] float -> (packed uint8 [rows, cols / 2], fp16 scales [rows, cols / GROUP])."""
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"int4: {cols} columns do not split into groups of {GROUP}")
    g = w.detach().float().cpu().reshape(rows, cols // GROUP, GROUP)
    amax = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    best_err = best_q = best_s = None
    for level in CLIP_LEVELS:
        # the fp16-rounded scale is the one loading multiplies by, so the error is measured with it
        s = (amax * level / 7.0).half().float().clamp(min=1e-12)
        q = torch.round(g / s).clamp(-8, 7)
        err = ((q * s - g) ** 2).sum(dim=2, keepdim=True)
        if best_err is None:
            best_err, best_q, best_s = err, q, s
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better, q, best_q)
            best_s = torch.where(better, s, best_s)
    codes = (best_q.reshape(rows, cols) + 8).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return packed, best_s.reshape(rows, cols // GROUP).half().contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_int4`, as `dtype`."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0]:
        raise ValueError(f"int4 tensor {tuple(packed.shape)} {packed.dtype} does not match its scales "
                         f"{tuple(scale.shape)}")
    rows, half = packed.shape
    cols = 2 * half
    if scale.shape[1] == 0 or cols % scale.shape[1]:
        raise ValueError(f"int4 tensor of {cols} columns cannot have {scale.shape[1]} scale groups")
    group = cols // scale.shape[1]
    codes = torch.empty(rows, cols, dtype=torch.int16)
    codes[:, 0::2] = (packed & 0x0F).to(torch.int16)
    codes[:, 1::2] = (packed >> 4).to(torch.int16)
    w = (codes.float() - 8.0).reshape(rows, cols // group, group) * scale.float()[:, :, None]
    return w.reshape(rows, cols).to(dtype)


def quantize_state_int4(state: dict[str, torch.Tensor], min_numel: int) -> dict[str, torch.Tensor]:
    """Every matrix that `can_quantize` as int4 + scales; everything else as fp16."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(Q4_SCALE_SUFFIX):
            raise ValueError(f"{name}: a tensor name may not end in {Q4_SCALE_SUFFIX}")
        if can_quantize(w, min_numel):
            out[name], out[name + Q4_SCALE_SUFFIX] = quantize_int4(w)
        else:
            out[name] = w.detach().cpu().half().contiguous()
    return out
