"""`spd serve`: an OpenAI-compatible HTTP server on the SPD runtime (docs/serve.md).

Starts the ranks once (spawned, or under `torchrun`, where rank 0 serves and the other ranks run
their stages) and keeps them, KV caches and CUDA graphs included, for the life of the server.
Up to `--max-batch B` requests share the pipeline (auto: 4 for SPD on a CPU, else 1); others wait in a
bounded queue, latency-critical ones first, then lower `priority` (as vLLM orders it), then in arrival order.
Its optional dependencies (the `serve` extra) are checked before anything starts: nothing here
imports them at module level, so without them the command still says so in one line.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from spd_engine.engine.runtime.run_config import Mode
from spd_engine.server import limits
from spd_engine.server.request_log import DEFAULT_LEVEL, LEVELS
from spd_engine.tools.cli_conventions import add_batch_arguments, check_batch_arguments, finite_float, resolve_max_batch
from spd_engine.tools.engine_args import add_engine_arguments, engine_config

SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus_client"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    g.add_argument("--served-model-name", default=None, help="model id of the API (default: --model)")
    g.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the one in the pipeline; "
                                                             "one more is answered 429 (0: one request at a time)")
    add_batch_arguments(g, "requests (a queued one joins when a slot is free)", auto=True)
    g.add_argument("--request-timeout", type=finite_float, default=600.0,
                   help="deadline of a request from its arrival, queue wait included (s)")
    g.add_argument("--drain-timeout", type=finite_float, default=30.0,
                   help="on SIGTERM: how long held requests may run before they are cancelled (s)")
    g.add_argument("--stall-timeout", type=finite_float, default=10.0,
                   help="a request in the pipeline that commits no token for this long while no rank computes "
                        "(or a rank is stopped or gone) fails naming the rank, and the server exits 1 (s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="every request generates its max_tokens, past EOS (benchmarks; per request: the "
                        "ignore_eos field)")
    g.add_argument("--max-request-bytes", type=int, default=limits.DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are answered 413 before they are read or parsed")
    g.add_argument("--header-timeout", type=finite_float, default=limits.DEFAULT_HEADER_TIMEOUT_S,
                   help="a connection that sends no complete request head this long after it opens (or after "
                        "its last answer) is closed (s)")
    g.add_argument("--body-timeout", type=finite_float, default=limits.DEFAULT_BODY_TIMEOUT_S,
                   help="a request whose body has not arrived this long after its head gets 408 (s)")
    g.add_argument("--max-connections", type=int, default=limits.DEFAULT_MAX_CONNECTIONS,
                   help="open connections held at most (lowered to fit the open-file limit); past it the one "
                        "waiting longest for a request head is closed, or the new one gets 503")
    g.add_argument("--max-in-flight", type=int, default=limits.DEFAULT_MAX_IN_FLIGHT,
                   help="requests between their head and the end of their answer; one more gets 503 at once")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints (visible in ps: prefer "
                        "--api-key-file or $SPD_API_KEY; default: none)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from the first line of FILE")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without an API key, a DNS name clients may send as Host (besides IP addresses and "
                        "localhost); repeatable")
    g.add_argument("--unhealthy-grace", type=finite_float, default=2.0,
                   help="after a rank failure: how long /health answers 503 before the server exits (s)")
    g.add_argument("--exit-deadline", type=finite_float, default=20.0,
                   help="after a rank failure: exit 1 by this time whatever still blocks (s)")
    g.add_argument("--startup-timeout", type=finite_float, default=600.0, help="time for the ranks to come up (s)")
    g.add_argument("--log-level", default=DEFAULT_LEVEL, choices=LEVELS,
                   help="info: one line per request; warning: drains, failures and errors only")


def check_arguments(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    check_batch_arguments(args)
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    args.api_key = api_key(args)
    for name in ("max_connections", "max_in_flight"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("request_timeout", "drain_timeout", "exit_deadline", "startup_timeout", "stall_timeout",
                 "header_timeout", "body_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.unhealthy_grace < args.exit_deadline:
        raise ValueError("--unhealthy-grace must be >= 0 and below --exit-deadline")


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key, else of --api-key-file (its first line), else $SPD_API_KEY; None: no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    key, source = args.api_key, "--api-key"
    if args.api_key_file is not None:
        source = f"--api-key-file {args.api_key_file}"
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{source}: cannot read it ({err})") from None
    elif key is None and "SPD_API_KEY" in os.environ:
        key, source = os.environ["SPD_API_KEY"], "SPD_API_KEY"
    if key is None:
        return None
    if not key.strip():
        raise ValueError(f"{source}: the API key is empty")
    return key.strip()


def check_dependencies() -> None:
    """The `serve` extra, before any model is resolved or rank started: each package imported, so a
    broken install (fastapi without starlette) is one line as well, naming what failed."""
    missing, broken = [], []
    for pkg, module in SERVE_MODULES.items():
        if importlib.util.find_spec(module) is None:
            missing.append(pkg)
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            broken.append(f"{pkg} ({err})")
    if missing or broken:
        named = ", ".join(missing + broken)
        raise ValueError(f"spd serve needs {named}: pip install 'spd-engine[serve]'" if not broken else
                         f"spd serve needs {named} to import: pip install --force-reinstall 'spd-engine[serve]'")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    check_dependencies()
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.launch import launch, under_torchrun
    from spd_engine.engine.runtime.run_config import random_preset
    from spd_engine.server.app import build_app
    from spd_engine.server.connections import ConnectionGuard, guarded_protocol
    from spd_engine.server.engine_loop import EngineLoop
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.in_flight import InFlightCap
    from spd_engine.server.request import ModelInfo
    from spd_engine.server.request_log import configure
    from spd_engine.server.runner import bind, run_server
    from spd_engine.server.shm_sweep import sweep_semaphores
    from spd_engine.server.tokenizing import PromptEncoder
    from spd_engine.tools.model_args import text_needs_tokenizer

    configure(args.log_level)
    swept = sweep_semaphores()
    if swept:
        print(f"spd serve: removed {swept} semaphore(s) in /dev/shm that killed processes left", file=sys.stderr)
    ecfg, tok_dir = engine_config(args)
    args.max_batch = resolve_max_batch(args, ecfg.mode, ecfg.parallel.device)
    if args.max_rows is not None and args.max_batch < 2:
        raise ValueError(f"--max-rows {args.max_rows}: needs --max-batch B >= 2")
    if args.max_batch > 1 and ecfg.mode is not Mode.SPD:
        raise ValueError(f"--max-batch > 1 needs --mode spd, got --mode {ecfg.mode}")
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        with launch(ecfg):  # a stage rank: serves its stage, exits when the driver shuts down
            raise AssertionError("only rank 0 enters the runtime")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    info = ModelInfo(name=args.served_model_name or args.model, tok=tok, tok_dir=tok_dir,
                     vocab_size=ecfg.model.cfg.vocab_size, capacity=ecfg.runtime.capacity,
                     eos_ids=tuple(tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids),
                     seed_limit=1 << 64 if ecfg.mode is Mode.SPD else 1 << 63)
    sock = bind(args.host, args.port)  # fail on a taken port before the ranks start
    if ecfg.drafting.pdm == "random" and ecfg.mode is Mode.SPD:
        print("spd: no trained head for this model and n; using an untrained one (lossless, but slow)",
              file=sys.stderr)
    refusal = text_needs_tokenizer(args.model) if tok is None and random_preset(ecfg.model.source) is None else None
    encoder = PromptEncoder(tok, tok_dir, ecfg.runtime.capacity, text_refusal=refusal)  # token-id prompts pass
    engine = EngineLoop(lambda: launch(ecfg, on_ranks=engine.set_ranks), args.max_queue,
                        () if args.ignore_eos else info.eos_ids,
                        rank_processes=lambda: list(engine.ranks.values()), stall_s=args.stall_timeout,
                        max_batch=args.max_batch, max_rows=args.max_rows)
    metrics = ServeMetrics(ecfg.parallel.topology.n, engine.waiting, engine.running, info.name, engine.stage_counts)
    engine.metrics = metrics
    try:
        encoder.start()
        try:
            engine.start(timeout=args.startup_timeout)
        except RuntimeError as err:
            if engine.state != "starting":  # the start failed (its own error says why)
                raise
            print(f"spd serve: {err} (--startup-timeout); exiting", file=sys.stderr)  # a fault after start: exit 1
            return 1
        app = build_app(engine, info, metrics, args.request_timeout, encoder, args.api_key, args.max_request_bytes,
                        frozenset(h.lower() for h in args.allowed_host))
        app = InFlightCap(app, args.max_in_flight, lambda path: metrics.outcome("unavailable")
                          if path.startswith("/v1/") else None)
        guard = ConnectionGuard(args.header_timeout, args.body_timeout, connection_limit(args.max_connections))
        return run_server(engine, app, sock, args.drain_timeout, args.unhealthy_grace, args.exit_deadline,
                          args.log_level, guarded_protocol(guard))
    finally:
        encoder.close()
        engine.kill_ranks()  # a no-op after a clean shutdown (the ranks have exited)


def connection_limit(wanted: int) -> int:
    """--max-connections, lowered (and said so) to fit the open-file limit, which is first raised to
    the hard limit."""
    soft, hard = limits.raise_open_file_limit()
    cap = limits.connection_cap(wanted, soft, limits.open_descriptors())
    if cap < wanted:
        print(f"spd serve: holding at most {cap} connections (--max-connections {wanted}): the open-file limit is "
              f"{soft} (hard {hard})", file=sys.stderr)
    return cap
