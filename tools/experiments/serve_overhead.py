"""Streaming overhead of `spd serve`: the same greedy request run directly on the ranks, as
`spd generate` runs it, and streamed through the server, side by side in one process on the
same ranks.

    spd measure serve-overhead --prompt "Why is the sky blue?" --max-tokens 64 --repeats 5 \\
        -- --model smollm2-135m --stages 4

One server (arguments after `--` are `spd serve`'s) is started in this process: its engine
thread owns the ranks. Each repeat runs the request twice, in alternating order: `direct` is
`runtime.generate` on the engine thread with `spd generate`'s on_token (detokenize, print to
/dev/null, flush); `server` is a streamed chat completion from an HTTP client on 127.0.0.1
(a thread of this process, so its own work counts against the server). Per-token latency is
the median gap between consecutive tokens (direct: on_token calls; server: SSE chunks as the
client receives them); reported: the median over repeats of each, and the server's overhead.
Both paths must give the same text.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import httpx

from spd_engine.tools.cli import HelpFormatter


def direct_run(runtime, ids: list[int], max_tokens: int, eos, tok) -> dict:
    """The request as `spd generate` runs it (tools/generate.py run): stream text to a file, flushed."""
    from spd_engine.engine.model.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    times, pieces = [], []
    with open(os.devnull, "w") as sink:
        def on_token(t: int) -> None:
            times.append(time.perf_counter())
            piece = detok.push(t)
            pieces.append(piece)
            print(piece, end="", file=sink, flush=True)

        t0 = time.perf_counter()
        res = runtime.generate(ids, max_tokens, eos, on_token=on_token)
        pieces.append(detok.flush())
    return {"text": "".join(pieces), "ttft_s": times[0] - t0, "times": times, "tokens": len(res.tokens),
            "decode_s": res.decode_s}


def server_run(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    times, pieces, usage = [], [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                usage = event
            elif event["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                pieces.append(event["choices"][0]["delta"]["content"])
    return {"text": "".join(pieces), "ttft_s": times[0] - t0, "times": times,
            "tokens": usage["usage"]["completion_tokens"], "decode_s": usage["spd"]["decode_s"]}


def gap_ms(times: list[float]) -> float:
    """Median gap between consecutive tokens (ms)."""
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))


def start_server(serve_argv: list[str]):
    """(engine, url, uvicorn server, model info): `spd serve`'s parts, the HTTP server in a thread."""
    import multiprocessing

    import uvicorn

    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.server.app import build_app
    from spd_engine.server.engine_loop import EngineLoop
    from spd_engine.server.exporter import ServeMetrics
    from spd_engine.server.request import ModelInfo
    from spd_engine.server.runner import bind
    from spd_engine.tools import serve
    from spd_engine.tools.engine_args import engine_config

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(serve_argv)
    ecfg, tok_dir = engine_config(args)
    if tok_dir is None:
        raise ValueError("the overhead benchmark streams chat text: use a model with a tokenizer")
    tok = Tokenizer.from_dir(tok_dir)
    info = ModelInfo(name=args.model, tok=tok, tok_dir=tok_dir, vocab_size=ecfg.model.cfg.vocab_size,
                     capacity=ecfg.runtime.capacity, eos_ids=tuple(tok.eos_ids))
    engine = EngineLoop(lambda: launch(ecfg), args.max_queue, info.eos_ids,
                        rank_processes=multiprocessing.active_children)
    engine.metrics = ServeMetrics(ecfg.parallel.topology.n, engine.waiting, lambda: int(engine.current is not None))
    engine.start(timeout=args.startup_timeout)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, info, engine.metrics, args.request_timeout),
                                           log_level="warning", lifespan="off", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    host, port = sock.getsockname()[:2]
    return engine, f"http://{host}:{port}", server, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure serve-overhead", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--prompt", default="Why is the sky blue?", help="the chat request's one user turn")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="requests on each path, alternating")
    p.add_argument("--json-out", default=None, help="write the report here as JSON")
    p.add_argument("serve_args", nargs="*", help="after --: arguments of spd serve (model, stages, ...)")
    args = p.parse_args(argv)
    engine, url, server, info = start_server(args.serve_args or ["--model", "smollm2-135m"])
    ids = info.tok.chat_ids(args.prompt)  # what the server sends for one user turn
    runs = {"direct": [], "server": []}
    try:
        server_run(url, info.name, args.prompt, 4)  # warm both paths once
        for r in range(args.repeats):
            order = ("direct", "server") if r % 2 == 0 else ("server", "direct")
            for kind in order:
                if kind == "direct":
                    out = engine.call(lambda rt: direct_run(rt, ids, args.max_tokens, info.eos_ids, info.tok))
                else:
                    out = server_run(url, info.name, args.prompt, args.max_tokens)
                runs[kind].append(out)
    finally:
        server.should_exit = True
        engine.stop(timeout=60)
    texts = {run["text"] for kind in runs for run in runs[kind]}
    report = {"prompt": args.prompt, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "serve_args": args.serve_args, "same_text": len(texts) == 1}
    for kind, rs in runs.items():
        report[kind] = {"per_token_ms_median": statistics.median(gap_ms(x["times"]) for x in rs),
                        "per_token_ms_runs": [round(gap_ms(x["times"]), 3) for x in rs],
                        "ttft_ms_median": 1e3 * statistics.median(x["ttft_s"] for x in rs),
                        "decode_ms_per_token_median": 1e3 * statistics.median(x["decode_s"] / max(1, x["tokens"] - 1)
                                                                              for x in rs),
                        "tokens": [x["tokens"] for x in rs]}
    d, s = report["direct"]["per_token_ms_median"], report["server"]["per_token_ms_median"]
    report["streaming_overhead_pct"] = 100.0 * (s / d - 1.0)
    print(json.dumps(report, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["same_text"] else 1

