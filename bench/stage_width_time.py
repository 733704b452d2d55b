"""What a stage step costs when it carries W tokens (branch width W, docs/design.md 3.11): one
stage of a preset's shape (random weights, real sizes) runs a decode step of 1, 2 and 4 tokens
in the shape a tree step has: W tokens at the same position, each seeing the shared prefix and
itself (a tree attention mask). With `--layouts row,col,packed` each width runs over each weight
layout (engine/model/linear.py), the same weights. The widths (and layouts) are timed in
alternation so host drift hits them alike; medians, and each one's ratio to W = 1 in the first layout.

    spd measure stage-width-time [--preset smollm2-135m] [--layers 8] [--widths 1,2,4] [--layouts row,col,packed]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from spd_engine.engine.model.linear import LAYOUTS, set_weight_layout_
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.kernels.packed_linear import packed_kernel_available


def tree_mask(prefix: int, width: int) -> torch.Tensor:
    """Bool [W, prefix + W]: every token sees the prefix and itself, not its sibling chains."""
    return torch.cat([torch.ones(width, prefix, dtype=torch.bool), torch.eye(width, dtype=torch.bool)], dim=1)


def time_widths(preset: str, layers: int, widths: tuple[int, ...], prefix: int = 300, iters: int = 60,
                warmup: int = 10, layouts: tuple[str, ...] = ("row",)) -> dict[tuple[str, int], float]:
    """Median ms per stage step of a preset's shape for each (layout, width)."""
    cfg = PRESETS[preset]
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"--layers must be in 1..{cfg.num_layers} for {preset}, got {layers}")
    return time_stage(cfg, layers, widths, prefix, iters, warmup, layouts)


def layer_bytes(cfg: ModelConfig) -> int:
    """fp32 bytes of one decoder layer's linear weights (q, k, v, o, gate, up, down)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 4 * cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)


def time_layouts(cfg: ModelConfig, threads: int, stage_mb: float = 200.0, iters: int = 8
                 ) -> dict[tuple[str, int], float]:
    """What `spd bench` chooses a weight layout from (engine/runtime/measured_layout.py): a stage of the
    model's shape holding about `stage_mb` of weights (more than a CPU's caches, as a real stage; 1 to
    16 layers), on `threads` intra-op threads, each layout the device has at the measured widths."""
    from spd_engine.engine.runtime.measured_layout import TIMED, WIDTHS

    layers = max(1, min(16, cfg.num_layers, round(stage_mb * 2**20 / layer_bytes(cfg))))
    layouts = tuple(lay for lay in TIMED if lay != "packed" or packed_kernel_available())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return time_stage(cfg, layers, WIDTHS, iters=iters, warmup=2, layouts=layouts)
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def time_stage(cfg: ModelConfig, layers: int, widths: tuple[int, ...], prefix: int = 300, iters: int = 60,
               warmup: int = 10, layouts: tuple[str, ...] = ("row",)) -> dict[tuple[str, int], float]:
    """Median ms per step of `layers` of `cfg`'s shape (random weights) for each (layout, width)."""
    base = init_random_(StageModel(cfg, range(layers))).eval()
    stages = {lay: copy.deepcopy(base) for lay in layouts}  # the same weights in each layout
    for lay, stage in stages.items():
        set_weight_layout_(stage, lay)
    cache = base.new_cache(1, prefix + max(widths))
    h = {w: torch.randn(1, w, cfg.hidden_size) for w in widths}  # [1, W, H]
    pos = {w: torch.full((1, w), prefix) for w in widths}  # [1, W]: siblings share the position
    masks = {w: tree_mask(prefix, w) if w > 1 else None for w in widths}
    times: dict[tuple[str, int], list[float]] = {(lay, w): [] for lay in layouts for w in widths}
    for _ in range(warmup + iters):
        for lay, stage in stages.items():
            for w in widths:
                t0 = time.perf_counter()
                stage.forward_layers(h[w], cache, prefix, pos[w], masks[w])
                times[(lay, w)].append(time.perf_counter() - t0)
    return {key: 1e3 * statistics.median(v[warmup:]) for key, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure stage-width-time", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS), help="the model shape (random weights)")
    p.add_argument("--layers", type=int, default=8, help="layers in the stage (SmolLM2 at n=4: 8)")
    p.add_argument("--widths", default="1,2,4", help="sibling tokens W per stage step")
    p.add_argument("--prefix", type=int, default=300, help="tokens already in the KV cache")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--layouts", default="row", help=f"weight layouts to time, of {LAYOUTS} (the first is the reference)")
    args = p.parse_args(argv)
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    if not layouts or set(layouts) - set(LAYOUTS):
        p.error(f"--layouts must name some of {LAYOUTS}, got {args.layouts!r}")
    try:
        widths = tuple(int(x) for x in args.widths.split(","))
    except ValueError:
        p.error(f"--widths takes comma-separated integers, got {args.widths!r}")
    if 1 not in widths or min(widths) < 1:
        p.error("--widths must include 1 (the reference) and be >= 1")
    torch.set_num_threads(args.threads)
    try:
        t = time_widths(args.preset, args.layers, widths, args.prefix, layouts=layouts)
    except ValueError as err:
        p.error(str(err))
    base = t[(layouts[0], 1)]
    for lay in layouts:
        for w in widths:
            print(f"{lay} W={w}: {t[(lay, w)]:.2f} ms per stage step ({args.layers} layers of {args.preset}, "
                  f"prefix {args.prefix}, {args.threads} thread(s)), {t[(lay, w)] / base:.2f}x {layouts[0]} W=1")
    return 0

