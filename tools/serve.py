"""`spd serve`: an OpenAI-compatible HTTP server on the SPD runtime (docs/serve.md).

Starts the ranks once (spawned, or under `torchrun`, where rank 0 serves and the other ranks run
their stages) and keeps them, KV caches and CUDA graphs included, for the life of the server.
One request at a time goes through the pipeline; others wait in a bounded FIFO queue.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

from spd_engine.tools.common import add_engine_arguments, engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    g.add_argument("--served-model-name", default=None, help="model id of the API (default: --model)")
    g.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the one in the pipeline; "
                                                             "one more is answered 429")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline of a request from its arrival, queue wait included (s)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: how long held requests may run before they are cancelled (s)")
    g.add_argument("--unhealthy-grace", type=float, default=2.0,
                   help="after a rank failure: how long /health answers 503 before the server exits (s)")
    g.add_argument("--exit-deadline", type=float, default=20.0,
                   help="after a rank failure: exit 1 by this time whatever still blocks (s)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="time for the ranks to come up (s)")
    g.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def check_arguments(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    for name in ("request_timeout", "drain_timeout", "exit_deadline", "startup_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.unhealthy_grace < args.exit_deadline:
        raise ValueError("--unhealthy-grace must be >= 0 and below --exit-deadline")


def run(args: argparse.Namespace) -> int:
    from spd_engine.engine.runtime.launch import launch, under_torchrun
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.server.app import build_app
    from spd_engine.server.engine_loop import EngineLoop
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.request import ModelInfo
    from spd_engine.server.runner import bind, run_server

    check_arguments(args)
    ecfg, tok_dir = engine_config(args)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        with launch(ecfg):  # a stage rank: serves its stage, exits when the driver shuts down
            raise AssertionError("only rank 0 enters the runtime")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    info = ModelInfo(name=args.served_model_name or args.model, tok=tok, tok_dir=tok_dir,
                     vocab_size=ecfg.cfg.vocab_size, capacity=ecfg.capacity,
                     eos_ids=tuple(tok.eos_ids if tok is not None else ecfg.cfg.eos_token_ids),
                     seed_limit=1 << 64 if ecfg.mode == "spd" else 1 << 63)
    sock = bind(args.host, args.port)  # fail on a taken port before the ranks start
    if ecfg.pdm == "random" and ecfg.mode == "spd":
        print("spd: no trained head for this model and n; using an untrained one (lossless, but slow)",
              file=sys.stderr)
    engine = EngineLoop(lambda: launch(ecfg), args.max_queue, info.eos_ids,
                        rank_processes=multiprocessing.active_children)
    metrics = ServeMetrics(ecfg.topology.n, engine.waiting, lambda: int(engine.current is not None))
    engine.metrics = metrics
    engine.start(timeout=args.startup_timeout)
    app = build_app(engine, info, metrics, args.request_timeout)
    return run_server(engine, app, sock, args.drain_timeout, args.unhealthy_grace, args.exit_deadline,
                      args.log_level)
