"""Triton kernel for the anchor gather + projection (see kernels/anchor_gather.py for the API).

One launch computes every row. Program `(n_block, type, row_block)` owns output columns
`n_block` of the rows (within `row_block`) whose aggregation type is `type`, so each weight
element is read once per launch however many rows share a type. The K-loop reads the PDM
input straight out of the ring: anchors `0..a` of a slot are the contiguous prefix
`ring[slot, :a+1, :]`, so K index `j` of type `a` is element `slot * A * H + j` of the
ring, and no concatenated input is ever materialised. Products accumulate in fp32.

Only Triton features present since 3.0 are used (checked against 3.6 and 3.9). The kernel
is wrapped by `triton.jit` lazily, so `TRITON_INTERPRET=1` decides per call whether it runs
compiled (CUDA) or in the interpreter (CPU tensors). It calls only core builtins (tl.load,
tl.dot, tl.full, ...), none of the @triton.jit library functions (tl.max, tl.zeros, tl.cdiv):
those are wrapped when triton is first imported, so under the interpreter they would only
work if TRITON_INTERPRET had been set before that import; core builtins have no such catch.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rows per program: tl.dot needs M >= 16; the staircase has n + 1 <= 17 rows


def _anchor_rows_body(ring_ptr, slots_ptr, types_ptr, packed_ptr, out_ptr,
                      num_rows, num_slots, slot_stride, hidden,
                      NUM_TYPES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                      BF16_BITS: tl.constexpr):
    pid_n = tl.program_id(0)
    t = NUM_TYPES - 1 - tl.program_id(1)  # heaviest type first: the long K-loops start early
    pid_r = tl.program_id(2)

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = offs_r < num_rows
    types = tl.load(types_ptr + offs_r, mask=row_ok, other=-1)
    slots = tl.load(slots_ptr + offs_r, mask=row_ok, other=0)
    # Out-of-range slots are masked so an unchecked call can never read outside the ring.
    mine = row_ok & (types == t) & (slots >= 0) & (slots < num_slots)  # [BLOCK_R]
    # A type no row uses runs zero K iterations: it reads no weights. The scalar loop stands in
    # for tl.max (see the module docstring on library functions).
    used = pid_r * 0  # int32 scalar: 1 if some row of this program has type t
    for i in tl.static_range(BLOCK_R):
        row = pid_r * BLOCK_R + i
        used = used | (tl.load(types_ptr + row, mask=row < num_rows, other=-1) == t).to(tl.int32)
    k_len = used * (t + 1) * hidden

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < hidden
    x_row = slots.to(tl.int64) * slot_stride  # [BLOCK_R] start of each row's slot in the ring
    # Type t's W^T is rows [t(t+1)/2 * H, ...) of the packed [blocks * H, H] matrix.
    w_type = packed_ptr + ((t * (t + 1)) // 2).to(tl.int64) * hidden * hidden

    acc = tl.full((BLOCK_R, BLOCK_N), 0.0, tl.float32)  # [BLOCK_R, BLOCK_N]
    for k0 in range(0, k_len, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = offs_k < k_len
        x = tl.load(ring_ptr + x_row[:, None] + offs_k[None, :],
                    mask=mine[:, None] & k_ok[None, :], other=0)  # [BLOCK_R, BLOCK_K]
        w = tl.load(w_type + offs_k.to(tl.int64)[:, None] * hidden + offs_n[None, :],
                    mask=k_ok[:, None] & n_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        if BF16_BITS:  # bf16 bits passed as int16 (see launch): they are the high half of fp32
            x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        if DOT_FP32:  # fp32 inputs, or the interpreter (see launch): exact fp32 products, no TF32
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:  # bf16/fp16 tensor-core dot, fp32 accumulator
            acc = tl.dot(x, w, acc)
    out_ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * hidden + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & n_ok[None, :])


def interpreting() -> bool:
    """Whether `triton.jit` currently builds interpreter kernels (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernel(interpret: bool):
    # triton.jit reads TRITON_INTERPRET when it wraps the function; caching by that flag keeps
    # a compiled and an interpreted kernel apart when both are used in one process.
    assert interpret == interpreting()
    return triton.jit(_anchor_rows_body)


def default_config(hidden: int, interpret: bool) -> dict[str, int]:
    """Tile sizes and launch options.

    The interpreter runs numpy per block and its cost is mostly per block, so it gets tiles as
    large as H allows (few iterations even at H=4096).
    """
    if interpret:
        tile = triton.next_power_of_2(hidden)
        return {"block_n": min(tile, 512), "block_k": min(tile, 2048), "num_warps": 4, "num_stages": 1}
    block_n = 32 if hidden <= 1024 else 64  # small H: more programs to fill the SMs
    return {"block_n": block_n, "block_k": 128, "num_warps": 4, "num_stages": 3}


def launch(ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor, packed: torch.Tensor,
           out: torch.Tensor, num_types: int, config: dict[str, int] | None = None) -> torch.Tensor:
    """Launch the kernel on validated inputs (see anchor_rows); writes and returns `out`."""
    num_slots, num_anchors, hidden = ring.shape
    num_rows = slots.shape[0]
    interpret = interpreting()
    cfg = dict(default_config(hidden, interpret), **(config or {}))
    grid = (triton.cdiv(hidden, cfg["block_n"]), num_types, triton.cdiv(num_rows, BLOCK_R))
    # The interpreter multiplies bf16 operands of tl.dot as raw uint16 bits, so it gets them
    # upcast; a bf16/fp16 product is exact in fp32, so the result is the same.
    dot_fp32 = interpret or ring.dtype == torch.float32
    # The interpreter also converts bf16 element by element in Python-level numpy (slow, and
    # every masked load converts its `other`); handing it the raw bits as int16 avoids that.
    bf16_bits = interpret and ring.dtype == torch.bfloat16
    if bf16_bits:
        ring, packed = ring.view(torch.int16), packed.view(torch.int16)
    _kernel(interpret)[grid](
        ring, slots, types, packed, out,
        num_rows, num_slots, num_anchors * hidden, hidden,
        NUM_TYPES=num_types, BLOCK_R=BLOCK_R, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        DOT_FP32=dot_fp32, BF16_BITS=bf16_bits, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
