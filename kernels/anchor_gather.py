"""Anchor gather + projection: PDM input rows straight from the driver's anchor ring buffer.

Every tick the driver turns anchor hidden states of the in-flight positions into PDM input
rows (docs/design.md 3.5): row `r = W_{types[r]} · concat(ring[slots[r], 0..types[r]])`, with
`W_a` of shape `[H, (a+1)H]` and no bias. Stage receives write anchor states into the
preallocated `ring [num_slots, num_anchors, H]`.

Packed weight layout (what `pack_projection_weights` returns and the kernel streams):
`packed [T(T+1)/2, H, H]` for `T` aggregation types; block `a(a+1)/2 + k` holds
`W_a[:, kH:(k+1)H]` transposed (`[H_in, H_out]`). The blocks of type `a` are therefore
consecutive and, flattened, form `W_a^T [(a+1)H, H]`: the K-loop walks contiguous rows of
`H_out` values, and K index `j` multiplies element `j` of the contiguous prefix
`ring[slot, :a+1]` of the ring. No padding: a padded `[T, T, H, H]` layout would store
almost twice the bytes.

`anchor_rows(..., impl="torch")` is the specification (plain indexing + matmul in fp32);
the Triton kernel (kernels/_anchor_gather_triton.py, imported only when used) must match it.
"""
from __future__ import annotations

import functools
import math

import torch

IMPLS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


# ---- packed weights ----

def num_blocks(num_types: int) -> int:
    """Packed `[H, H]` blocks for `num_types` aggregation types: 1 + 2 + ... + T."""
    return num_types * (num_types + 1) // 2


def num_types_of(packed: torch.Tensor) -> int:
    """Aggregation types stored in a packed weight tensor; ValueError if the layout is wrong."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 3 or packed.shape[1] != packed.shape[2]:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"packed weights must have shape [T(T+1)/2, H, H], got {shape}")
    blocks = packed.shape[0]
    t = (math.isqrt(8 * blocks + 1) - 1) // 2
    if blocks < 1 or num_blocks(t) != blocks:
        raise ValueError(f"packed weights hold {blocks} blocks, not a triangular number T(T+1)/2")
    return t


def pack_projection_weights(ws: list[torch.Tensor]) -> torch.Tensor:
    """Pack `ws[a] [H, (a+1)H]` (nn.Linear weight of W_a) into `[T(T+1)/2, H, H]` (see top)."""
    if not ws:
        raise ValueError("pack_projection_weights: need at least one projection weight")
    hidden = ws[0].shape[0]
    blocks = []
    for a, w in enumerate(ws):
        if w.dim() != 2 or tuple(w.shape) != (hidden, (a + 1) * hidden):
            raise ValueError(f"projection weight {a} must have shape [H, (a+1)H] = "
                             f"[{hidden}, {(a + 1) * hidden}], got {tuple(w.shape)}")
        if w.dtype != ws[0].dtype or w.device != ws[0].device:
            raise ValueError(f"projection weight {a} is {w.dtype} on {w.device}, weight 0 is "
                             f"{ws[0].dtype} on {ws[0].device}")
        blocks.append(w.t().reshape((a + 1), hidden, hidden))  # W_a^T [(a+1)H, H] -> blocks
    return torch.cat(blocks).contiguous()  # [T(T+1)/2, H, H]


def type_weight_t(packed: torch.Tensor, a: int) -> torch.Tensor:
    """View of `W_a^T [(a+1)H, H]` inside the packed tensor."""
    t = num_types_of(packed)
    assert 0 <= a < t, f"type {a} outside 0..{t - 1}"
    hidden = packed.shape[1]
    start = num_blocks(a)
    return packed[start:start + a + 1].reshape((a + 1) * hidden, hidden)


def unpack_projection_weights(packed: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of pack_projection_weights: `ws[a] [H, (a+1)H]`, fresh contiguous tensors."""
    return [type_weight_t(packed, a).t().contiguous() for a in range(num_types_of(packed))]


# ---- guards ----

def _check_tensor(name: str, x: object, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} dtype {x.dtype} not supported; expected one of {list(dtypes)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but ring is on {device}; all inputs must share a device")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride {tuple(x.stride())} for shape {tuple(x.shape)})")


def _check_indices(slots: torch.Tensor, types: torch.Tensor, num_slots: int, num_types: int) -> None:
    # One host sync for both checks; skipped while a CUDA graph is being captured.
    bad = torch.stack([((slots < 0) | (slots >= num_slots)).any(), ((types < 0) | (types >= num_types)).any()])
    bad_slots, bad_types = bad.tolist()
    if bad_slots:
        raise ValueError(f"slots out of range: {slots.tolist()} (ring has {num_slots} slots)")
    if bad_types:
        raise ValueError(f"types out of range: {types.tolist()} (packed weights have {num_types} types)")


def check_inputs(ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor, packed: torch.Tensor,
                 out: torch.Tensor | None, check_indices: bool = True) -> int:
    """Validate anchor_rows inputs; returns the number of aggregation types. ValueError names the problem."""
    if not isinstance(ring, torch.Tensor):
        raise ValueError(f"ring must be a torch.Tensor, got {type(ring).__name__}")
    _check_tensor("ring", ring, 3, FLOAT_DTYPES, ring.device)
    num_slots, num_anchors, hidden = ring.shape
    if min(num_slots, num_anchors, hidden) < 1:
        raise ValueError(f"ring shape {tuple(ring.shape)} has an empty dimension")
    _check_tensor("packed", packed, 3, (ring.dtype,), ring.device)
    num_types = num_types_of(packed)
    if packed.shape[1] != hidden:
        raise ValueError(f"packed weights have H={packed.shape[1]} but ring has H={hidden}")
    if num_types > num_anchors:
        raise ValueError(f"packed weights have {num_types} types but ring holds only {num_anchors} anchors")
    _check_tensor("slots", slots, 1, INDEX_DTYPES, ring.device)
    _check_tensor("types", types, 1, INDEX_DTYPES, ring.device)
    if slots.shape != types.shape:
        raise ValueError(f"slots has {slots.shape[0]} rows but types has {types.shape[0]}")
    if out is not None:
        _check_tensor("out", out, 2, (ring.dtype, torch.float32), ring.device)
        if tuple(out.shape) != (slots.shape[0], hidden):
            raise ValueError(f"out must have shape [R, H] = [{slots.shape[0]}, {hidden}], got {tuple(out.shape)}")
    capturing = ring.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_indices and not capturing and slots.numel():
        _check_indices(slots, types, num_slots, num_types)
    return num_types


# ---- the two implementations ----

def anchor_rows_reference(ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor,
                          packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The specification on validated inputs: gather, then one fp32 matmul per type, select by type.

    Every type is computed for every row and `types` selects, so no value is read back to the
    host and the function can be captured in a CUDA graph.
    """
    num_slots, num_anchors, hidden = ring.shape
    rows = slots.shape[0]
    x = ring.index_select(0, slots).reshape(rows, num_anchors * hidden).float()  # [R, A*H]
    acc = torch.zeros(rows, hidden, dtype=torch.float32, device=ring.device)  # [R, H]
    for a in range(num_types_of(packed)):
        y = x[:, :(a + 1) * hidden] @ type_weight_t(packed, a).float()  # [R, H]
        acc = torch.where((types == a)[:, None], y, acc)
    return out.copy_(acc)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_impl(impl: str, ring: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if ring.is_cuda and _triton_available() else "torch"
    if impl == "triton":
        if not _triton_available():
            raise ValueError("impl='triton' but triton is not installed; use impl='torch'")
        from spd_engine.kernels._anchor_gather_triton import interpreting
        if not ring.is_cuda and not interpreting():
            raise ValueError(f"impl='triton' on {ring.device} tensors needs TRITON_INTERPRET=1 "
                             "(the Triton interpreter); use CUDA tensors or impl='torch'")
    return impl


def anchor_rows(ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor, packed: torch.Tensor,
                out: torch.Tensor | None = None, impl: str = "auto", *, check_indices: bool = True,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """PDM input rows `[R, H]`: row r = W_{types[r]} · concat(ring[slots[r], 0..types[r]]).

    ring [num_slots, num_anchors, H] (bf16/fp16/fp32), slots/types [R] (int32/int64),
    packed from pack_projection_weights (ring's dtype). `out` [R, H] (ring's dtype or fp32)
    is written in place when given. impl: "auto" = Triton on CUDA tensors when triton
    imports, torch otherwise. `check_indices=False` skips the index-range check, the only
    guard that reads device values (a host sync); it is skipped anyway during CUDA graph
    capture. Rows with an out-of-range slot or type are then left unwritten by the Triton
    kernel, never read out of bounds. `config` overrides the Triton tile sizes (benchmarks).
    """
    num_types = check_inputs(ring, slots, types, packed, out, check_indices)
    impl = _resolve_impl(impl, ring)
    if out is None:
        out = torch.empty(slots.shape[0], ring.shape[2], dtype=ring.dtype, device=ring.device)
    if slots.shape[0] == 0:
        return out
    if impl == "torch":
        return anchor_rows_reference(ring, slots, types, packed, out)
    from spd_engine.kernels._anchor_gather_triton import launch
    return launch(ring, slots, types, packed, out, num_types, config)
