"""`spd netbench`: interconnect benchmark (P2P, all-reduce, fan-in, SPD tick replay).

Launches `--nproc` local ranks itself, or runs as one worker under `torchrun` (single or
multi-node). Rank 0 prints the tables and writes JSON, CSV and PNG.
"""
from __future__ import annotations

import argparse
import os
import sys

from spd_engine.bench.interconnect import NCCL_NOTE, NetbenchConfig, launch_local, netbench_rank, run_torchrun_rank
from spd_engine.bench.plot import format_report, plot_netbench, write_outputs
from spd_engine.bench.stats import parse_bytes
from spd_engine.bench.tick_replay import ReplayConfig
from spd_engine.engine.comm.dist import RunFailed, under_torchrun

TESTS = ("p2p", "allreduce", "fanin", "replay", "transport")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch locally (ignored under torchrun)")
    p.add_argument("--backend", default="auto", help="auto | gloo | nccl (auto: nccl with GPUs, else gloo)")
    p.add_argument("--tests", default="p2p,allreduce,fanin", help=f"comma list of {','.join(TESTS)}")
    p.add_argument("--sizes", help="explicit P2P sizes, e.g. 4,1K,64K (overrides --min/--max/--step-factor)")
    p.add_argument("--min-bytes", default="4", help="smallest P2P message (suffixes K, M, G)")
    p.add_argument("--max-bytes", default="64M", help="largest P2P message (suffixes K, M, G)")
    p.add_argument("--step-factor", type=int, default=4, help="ratio between successive P2P sizes (>= 2)")
    p.add_argument("--pairs", help="rank pairs like 0-1,1-2 (default: 0-r for every r, then r-(r+1))")
    p.add_argument("--iters", type=int, default=100, help="timed iterations per size (fewer above 1 MiB)")
    p.add_argument("--idle-gap-ms", type=float, default=2.0,
                   help="idle ping-pong for sizes up to 64 KiB: both ends idle this long first (0: skip)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before the timed ones")
    p.add_argument("--allreduce-bytes", default="4,8K", help="all-reduce sizes (a batch-1 TP activation is H*2 bytes)")
    p.add_argument("--allreduce-busy-us", type=float, default=0.0,
                   help="compute this long on every rank before each timed all-reduce, as a TP rank does between "
                        "its reductions (default 0: back to back)")
    p.add_argument("--busy-us", type=float, default=0.0,
                   help="--tests transport: the answering rank computes this long before each reply, as a stage "
                        "does (default 0)")
    p.add_argument("--busy-mb", type=float, default=0.0,
                   help="--tests transport: before each send both ends stream this many MiB of float32 weights "
                        "(matrix-vector products), so messages meet caches as a decode step leaves them (default 0)")
    p.add_argument("--allreduce-op", choices=("tp", "library"), default="tp",
                   help="tp: the runtime's TP all-reduce (all_gather + a sum in rank order); library: dist.all_reduce")
    p.add_argument("--hidden", type=int, default=4096, help="H of fan-in and replay payloads")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element of fan-in and replay payloads")
    p.add_argument("--fanin-rows", default="1,4", help="k of the [k,H] fan-in payloads")
    g = p.add_argument_group("tick replay (--tests replay)")
    g.add_argument("--stage-ms", help="per-stage synthetic compute, e.g. 3,2,4 (default: world-1 stages of 2 ms)")
    g.add_argument("--pdm-ms", type=float, default=0.5, help="the driver's synthetic PDM time per tick")
    g.add_argument("--verify-ms", type=float, default=0.2, help="the driver's synthetic verify time per draft")
    g.add_argument("--alpha", type=float, default=0.8, help="probability that a draft is accepted, in [0, 1]")
    g.add_argument("--tokens", type=int, default=64, help="generated tokens N (the first from the prefill)")
    g.add_argument("--seed", type=int, default=0, help="seed of the accept/reject draws")
    g.add_argument("--anchors", type=int, default=1, help="anchor rows k each stage sends the driver per tick")
    g.add_argument("--colocate", action="store_true", help="driver on the rank of stage 0")
    g.add_argument("--fault-rank", type=int, help="fault injection: this rank fails during the replay")
    g.add_argument("--fault-tick", type=int, default=3, help="the tick at which --fault-rank fails")
    g.add_argument("--fault", default="exit", choices=("exit", "stall"),
                   help="exit: the process dies; stall: it goes silent for three timeouts")
    p.add_argument("--link-delay-us", type=float, default=0.0, metavar="US",
                   help="emulated link latency, as the engine's --link-delay-us: added to every message of "
                        "--tests transport and each step of the tp all-reduce (default 0: none)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds any receive or collective may wait")
    p.add_argument("--out-dir", default="runs/netbench", help="where netbench.{json,csv,png} go ('' for none)")
    p.add_argument("--no-png", action="store_true", help="skip the PNG plot (saves importing matplotlib)")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness added to every local rank, e.g. -10 on a busy shared host (needs privileges)")


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def _sizes(args: argparse.Namespace) -> tuple[int, ...]:
    if args.sizes:
        return tuple(parse_bytes(s) for s in args.sizes.split(",") if s.strip())
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    if args.step_factor < 2 or lo > hi:
        raise ValueError("need --min-bytes <= --max-bytes and --step-factor >= 2")
    sizes = [lo]
    while sizes[-1] * args.step_factor <= hi:
        sizes.append(sizes[-1] * args.step_factor)
    return tuple(sizes)


def _pairs(text: str | None, world: int) -> tuple[tuple[int, int], ...] | None:
    if not text:
        return None
    pairs = []
    for item in text.split(","):
        try:
            a, b = (int(x) for x in item.split("-"))
        except ValueError:
            raise ValueError(f"--pairs entries look like 0-1, got {item!r}") from None
        if a == b or not (0 <= a < world and 0 <= b < world):
            raise ValueError(f"pair {item!r} is not two different ranks below the world size {world}")
        pairs.append((a, b))
    return tuple(pairs)


def build_config(args: argparse.Namespace, world: int) -> NetbenchConfig:
    tests = tuple(t.strip() for t in args.tests.split(",") if t.strip())
    unknown = set(tests) - set(TESTS)
    if unknown:
        raise ValueError(f"unknown tests {sorted(unknown)}; choose from {', '.join(TESTS)}")
    replay = []
    if "replay" in tests:
        stage_ms = (tuple(float(x) for x in args.stage_ms.split(",")) if args.stage_ms
                    else (2.0,) * (world if args.colocate else world - 1))
        sc = ReplayConfig(stage_ms=stage_ms, pdm_ms=args.pdm_ms, verify_ms=args.verify_ms, alpha=args.alpha,
                          tokens=args.tokens, seed=args.seed, hidden=args.hidden, dtype_bytes=args.dtype_bytes,
                          anchors=args.anchors, colocate=args.colocate, fault_rank=args.fault_rank,
                          fault_tick=args.fault_tick, fault=args.fault)
        sc.validate(world)
        replay.append(sc)
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    if not 0 <= args.link_delay_us < 1e6:
        raise ValueError(f"--link-delay-us must be in [0, 1e6), got {args.link_delay_us}")
    busy = (args.allreduce_busy_us, args.busy_us, args.busy_mb)
    if args.idle_gap_ms < 0 or args.iters < 1 or args.warmup < 0 or min(busy) < 0:
        raise ValueError("--idle-gap-ms, --allreduce-busy-us, --busy-us, --busy-mb and --warmup must be >= 0, "
                         "--iters >= 1")
    allreduce_bytes = tuple(parse_bytes(s) for s in args.allreduce_bytes.split(","))
    return NetbenchConfig(tests=tests, sizes=_sizes(args), pairs=_pairs(args.pairs, world), iters=args.iters,
                          warmup=args.warmup, allreduce_bytes=allreduce_bytes, allreduce_op=args.allreduce_op,
                          allreduce_busy_us=args.allreduce_busy_us, transport_busy_us=args.busy_us,
                          transport_busy_mb=args.busy_mb,
                          hidden=args.hidden,
                          dtype_bytes=args.dtype_bytes,
                          fanin_rows=_int_list(args.fanin_rows, "--fanin-rows"), replay=replay, timeout_s=args.timeout,
                          idle_gap_ms=args.idle_gap_ms, link_delay_us=args.link_delay_us)


def deadline_s(cfg: NetbenchConfig, world: int) -> float:
    """Safety-net wall time for a local launch; ranks time out on their own well before it."""
    replay = sum(sc.tokens * sc.n * (max(sc.stage_ms) + sc.pdm_ms + sc.verify_ms + 5) / 1e3 for sc in cfg.replay)
    return 120 + 4 * cfg.timeout_s + 3 * replay + 2 * len(cfg.sizes) * world


def run(args: argparse.Namespace) -> int:
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    cfg = build_config(args, world)
    if under_torchrun():
        report = run_torchrun_rank(netbench_rank, cfg, args.backend, args.timeout)
    else:
        try:
            report = launch_local(netbench_rank, cfg, args.nproc, args.backend, args.timeout,
                                  deadline_s(cfg, world), args.nice)
        except RunFailed as err:  # every rank already printed its own error
            print(f"spd netbench: error: {err}", file=sys.stderr)
            return 1
    if report is None:  # not rank 0 under torchrun
        return 0
    print(format_report(report))
    if args.out_dir:
        base = os.path.join(args.out_dir, "netbench")
        write_outputs(report, base + ".json", base + ".csv")
        png = plot_netbench(report, base + ".png") if report["p2p"] and not args.no_png else False
        skipped = " (no PNG: --no-png, no P2P rows or no matplotlib)"
        print(f"\nwrote {base}.json, {base}.csv" + (f", {base}.png" if png else skipped))
    if report["backend"] == "nccl":
        print(f"WARNING: {NCCL_NOTE}")
    return 0
