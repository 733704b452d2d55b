"""`spd bench-kernel`: GPU benchmark of the anchor-gather + projection kernel (kernels/anchor_gather.py).

For each model shape it builds the rows one steady-state tick feeds the PDM (the pending
full-depth row plus the staircase of the n in-flight tokens, types from the default anchor
plan) and times: the Triton kernel called eagerly and replayed from a CUDA graph, and the
torch reference eagerly and from a CUDA graph. The packed weights are rotated over enough
copies to exceed the L2 cache, so every call streams its weights from HBM as it would in a
tick whose other work evicted them. Bandwidth is the unique bytes a call must move (weights
of the types present, anchor states read, rows written, indices) over the graphed kernel
time, also as a fraction of a measured device-to-device copy bandwidth.
Prints a table, and with --json the JSON document (to stdout, or to FILE); needs CUDA and triton.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from spd_engine.bench.profiling import events_ms
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.topology import default_stage_layers, stage_bounds


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    num_layers: int
    n: int  # pipeline stages


SHAPES = {s.name: s for s in (
    Shape("smollm2-135m", 576, 30, 4),
    Shape("qwen3-4b", 2560, 36, 8),
    Shape("llama-3.1-8b", 4096, 32, 8),
)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Tile configurations tried by --sweep: (block_n, block_k, num_warps, num_stages).
SWEEP = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4),
         (32, 256, 4, 4), (64, 64, 2, 4), (128, 256, 8, 3)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated model shapes (default: all of {', '.join(SHAPES)})")
    from spd_engine.tools.cli_conventions import add_dtype_argument, add_json_argument

    add_dtype_argument(parser, "bfloat16", "packed weights, ring and rows")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--sweep", action="store_true", help="also time the tile configurations in SWEEP")
    add_json_argument(parser, "the results")


def bench_rows(shape: Shape) -> tuple[int, list[int]]:
    """(number of types, row types): the pending full-depth row, then lags 0..n-1 (docs/design.md 3.3)."""
    plan = AnchorPlan.build(stage_bounds(default_stage_layers(shape.num_layers, shape.n)))
    return plan.num_types, [plan.type_at_depth(shape.n)] + [plan.type_at_depth(j) for j in range(shape.n)]


def bytes_moved(hidden: int, types: list[int], elem: int) -> int:
    """Unique bytes one call must move: weights of the types present, anchor reads, rows out, int32 indices."""
    weights = sum((t + 1) * hidden * hidden for t in set(types))
    ring_reads = sum((t + 1) * hidden for t in types)
    return (weights + ring_reads + len(types) * hidden) * elem + 2 * len(types) * 4


def _graphed(calls) -> torch.cuda.CUDAGraph:
    """Capture all `calls` (one per rotated weight copy) into one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: compiles and allocates
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write) over a 1 GiB buffer."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def bench_shape(shape: Shape, dtype: torch.dtype, iters: int, sweep: bool, copy_bw: float) -> dict:
    from spd_engine.kernels.anchor_gather import anchor_rows, pack_projection_weights

    num_types, row_types = bench_rows(shape)
    hidden, rows = shape.hidden, len(row_types)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(hidden, (a + 1) * hidden, device="cuda", generator=gen).div_(((a + 1) * hidden) ** 0.5)
          for a in range(num_types)]
    packed = pack_projection_weights([w.to(dtype) for w in ws])  # [T(T+1)/2, H, H]
    del ws
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copies = [packed] + [packed.clone() for _ in range(min(63, math.ceil(3 * l2 / packed.nbytes)) - 1)]
    ring = torch.randn(2 * rows, num_types, hidden, device="cuda", generator=gen).to(dtype)  # [S, A, H]
    slots = torch.randperm(2 * rows, device="cuda", generator=gen)[:rows].to(torch.int32)
    types = torch.tensor(row_types, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, hidden, dtype=dtype, device="cuda")

    ref = anchor_rows(ring, slots, types, packed, impl="torch").float()
    got = anchor_rows(ring, slots, types, packed, impl="triton").float()
    rel_err = ((got - ref).norm() / ref.norm()).item()

    def calls(impl: str, config: dict | None = None) -> list:
        return [lambda p=p: anchor_rows(ring, slots, types, p, out=out, impl=impl, check_indices=False,
                                        config=config) for p in copies]

    def eager_ms(impl: str) -> float:
        cs = calls(impl)
        return events_ms(lambda: [c() for c in cs], max(1, iters // len(cs))) / len(cs)

    def graph_ms(impl: str, config: dict | None = None) -> float:
        graph = _graphed(calls(impl, config))
        return events_ms(graph.replay, max(1, iters // len(copies))) / len(copies)

    nbytes = bytes_moved(hidden, row_types, packed.element_size())
    result = {"shape": shape.name, "hidden": hidden, "n": shape.n, "types": num_types, "row_types": row_types,
              "rows": rows, "dtype": str(dtype).replace("torch.", ""), "weight_copies": len(copies),
              "bytes_moved": nbytes, "rel_err_vs_torch": rel_err,
              "kernel_eager_us": 1e3 * eager_ms("triton"), "kernel_graph_us": 1e3 * graph_ms("triton"),
              "torch_eager_us": 1e3 * eager_ms("torch"), "torch_graph_us": 1e3 * graph_ms("torch")}
    result["kernel_gbps"] = nbytes / (result["kernel_graph_us"] * 1e-6) / 1e9
    result["kernel_bw_fraction"] = result["kernel_gbps"] * 1e9 / copy_bw
    if sweep:
        result["sweep"] = [{"block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": ns,
                            "graph_us": 1e3 * graph_ms("triton", {"block_n": bn, "block_k": bk,
                                                                  "num_warps": nw, "num_stages": ns})}
                           for bn, bk, nw, ns in SWEEP]
    return result


def _parse(args: argparse.Namespace) -> list[Shape]:
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        raise ValueError(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}" if unknown
                         else "--shapes is empty")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    return [SHAPES[s] for s in names]


def _print_table(results: list[dict], copy_bw: float) -> None:
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    head = ("shape", "H", "types", "rows", "MB", "rel err", "kern eager us", "kern graph us",
            "torch eager us", "torch graph us", "GB/s", "of copy")
    print("  ".join(f"{h:>14}" for h in head))
    for r in results:
        cells = (r["shape"], r["hidden"], r["types"], r["rows"], f"{r['bytes_moved'] / 1e6:.1f}",
                 f"{r['rel_err_vs_torch']:.1e}", f"{r['kernel_eager_us']:.1f}", f"{r['kernel_graph_us']:.1f}",
                 f"{r['torch_eager_us']:.1f}", f"{r['torch_graph_us']:.1f}", f"{r['kernel_gbps']:.0f}",
                 f"{100 * r['kernel_bw_fraction']:.0f}%")
        print("  ".join(f"{c:>14}" for c in cells))
        for s in r.get("sweep", []):
            print(f"{'':>14}  sweep block_n={s['block_n']} block_k={s['block_k']} warps={s['num_warps']} "
                  f"stages={s['num_stages']}: {s['graph_us']:.1f} us")


def run(args: argparse.Namespace) -> int:
    shapes = _parse(args)
    if not torch.cuda.is_available():
        raise ValueError("bench-kernel needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("bench-kernel needs triton, which is not installed") from None
    dtype = DTYPES[args.dtype]
    copy_bw = copy_bandwidth()
    results = [bench_shape(s, dtype, args.iters, args.sweep, copy_bw) for s in shapes]
    _print_table(results, copy_bw)
    doc = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_gbps": copy_bw / 1e9, "results": results}
    if args.json:
        from spd_engine.tools.cli_conventions import write_json

        write_json(args.json, doc)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    bad = [r["shape"] for r in results if not r["rel_err_vs_torch"] <= tol]
    if bad:
        print(f"bench-kernel: kernel disagrees with the torch reference on {bad}", file=sys.stderr)
        return 1
    return 0
