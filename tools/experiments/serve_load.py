"""Bounded load test of `spd serve` on 127.0.0.1: concurrent streaming clients, optionally
disconnecting at random, every response checked against the same request served alone.

    spd measure serve-load --clients 16 --requests 3 --max-tokens 16 --max-queue 8 \\
        --disconnect 0.3 --json-out serve_load.json -- --model smollm2-135m --stages 4
    spd measure serve-load --clients 16 --requests 2 --max-tokens 32 --max-batch 1,4 --disconnect 0 \\
        -- --model smollm2-135m --stages 2 --colocate     # B = 1 against B = 4, one server each

Starts the server (arguments after `--`), serves every prompt once alone (the reference: greedy,
so the reply is fixed), then runs two phases of `clients` threads with `requests` streamed chat
requests each (a distinct prompt per request): phase `steady`, then phase `disconnect` where each
request is dropped with probability `--disconnect` after a random number of chunks. A 429 is
retried after a short pause. Checks, per phase: every kept response ended with `data: [DONE]`
and a finish_reason and equals its reference (nothing lost, cut or mixed); a dropped one is a
prefix of its reference; every 429 says the queue was full and, in the phase without drops,
came while the clients had at least max_queue + B other requests outstanding (B: the server's
--max-batch); afterwards the queue is empty, /health ok, and the cancellations the server counted
are at most the disconnects. Reports p50/p99 of time to first token and end-to-end latency (client
side, queue wait included) and the aggregate completion tokens/s of the phase. With `--max-batch
1,4` the whole test runs once per value, each on its own server, and a table compares them (the
reference replies are each server's own, served one at a time). Exit 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from spd_engine.bench.stats import percentile
from spd_engine.server.process import ServerProcess
from spd_engine.tools.cli import HelpFormatter


@dataclass
class Outcome:
    prompt: int
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    dropped: bool = False  # the client went away on purpose
    ttft_s: float | None = None
    e2e_s: float | None = None
    rejections: list[int] = field(default_factory=list)  # per 429: the most other requests outstanding meanwhile
    error: str | None = None
    tokens: int = 0  # completion tokens (the stream's usage chunk)


class Outstanding:
    """Requests sent and not yet fully answered, as the clients see them: at every instant at least
    what the server holds (a client counts a request before the server sees it and until after
    the server is done with it). Each attempt keeps the peak count over its own lifetime."""

    def __init__(self) -> None:
        self.n, self.lock = 0, threading.Lock()
        self.peaks: dict[int, int] = {}

    def enter(self, key: int) -> None:
        with self.lock:
            self.n += 1
            self.peaks[key] = self.n
            for k in self.peaks:
                self.peaks[k] = max(self.peaks[k], self.n)

    def leave(self, key: int) -> int:
        """End an attempt; the most requests (itself included) outstanding at any time during it."""
        with self.lock:
            self.n -= 1
            return self.peaks.pop(key)


def prompts(count: int) -> list[str]:
    return [f"In one sentence, what is special about the number {k + 1}?" for k in range(count)]


def one_request(http: httpx.Client, url: str, body: dict, drop_after: int | None, outstanding: Outstanding,
                limit: int, o: Outcome) -> None:
    """Stream one request until it completes (a 429 is retried after a pause) or is dropped after
    `drop_after` text chunks."""
    key = id(o)
    while True:
        outstanding.enter(key)
        try:
            status = _attempt(http, url, body, drop_after, limit, o)
        finally:
            peak = outstanding.leave(key)
        if status != 429:
            return
        o.rejections.append(peak - 1)
        time.sleep(random.uniform(0.2, 0.6))


def _attempt(http: httpx.Client, url: str, body: dict, drop_after: int | None, limit: int, o: Outcome) -> int:
    t0 = time.monotonic()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with http.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code == 429:
            msg = json.loads(r.read())["error"]["message"]
            if f"(limit {limit})" not in msg:
                o.error = f"429 without a full queue: {msg}"
        elif r.status_code != 200:
            o.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
        else:
            _read_stream(r, t0, drop_after, o)
        return r.status_code


def _read_stream(r: httpx.Response, t0: float, drop_after: int | None, o: Outcome) -> None:
    pieces, chunks = [], 0
    for line in r.iter_lines():
        if not line:
            continue
        if line == "data: [DONE]":
            o.done = True
            break
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            o.error = event["error"]["message"]
            return
        if event.get("usage"):
            o.tokens = event["usage"]["completion_tokens"]
        if not event["choices"]:
            continue
        choice = event["choices"][0]
        text = choice["delta"].get("content") if "delta" in choice else choice["text"]
        if text:
            if o.ttft_s is None:
                o.ttft_s = time.monotonic() - t0
            pieces.append(text)
            chunks += 1
        o.finish_reason = choice["finish_reason"] or o.finish_reason
        if drop_after is not None and chunks >= drop_after:
            o.dropped = True
            break  # leaving the stream closes the connection mid-reply
    o.text = "".join(pieces)
    o.e2e_s = time.monotonic() - t0


def request_body(model: str, prompt: str, max_tokens: int, chat: bool) -> dict:
    ask = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {"model": model, **ask, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def run_phase(url: str, bodies: list[dict], clients: int, per_client: int, limit: int, drop_p: float,
              rng: random.Random) -> tuple[list[Outcome], float]:
    """`clients` threads, each streaming its `per_client` requests one after another: their
    outcomes and the phase's wall seconds."""
    outstanding = Outstanding()
    outcomes: list[Outcome] = []
    max_tokens = bodies[0]["max_tokens"]
    plan = [[(c * per_client + i, rng.randint(1, max(1, max_tokens - 2)) if rng.random() < drop_p else None)
             for i in range(per_client)] for c in range(clients)]

    def client(jobs) -> None:
        with httpx.Client(timeout=600) as http:
            for k, drop_after in jobs:
                o = Outcome(prompt=k)
                outcomes.append(o)
                try:
                    one_request(http, url, bodies[k], drop_after, outstanding, limit, o)
                except httpx.HTTPError as err:
                    o.error = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=client, args=(jobs,)) for jobs in plan]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.monotonic() - t0


def check(outcomes: list[Outcome], refs: list[str], limit: int, running: int = 1) -> list[str]:
    """Problems of a phase. The outstanding-count check needs a phase without drops: a dropped
    request leaves the clients' count at once but the server's only at its next token."""
    problems = []
    count_bound = not any(o.dropped for o in outcomes)
    for o in outcomes:
        ref = refs[o.prompt]
        if o.error:
            problems.append(f"prompt {o.prompt}: {o.error}")
        elif o.dropped:
            if not ref.startswith(o.text):
                problems.append(f"prompt {o.prompt}: dropped reply {o.text!r} is not a prefix of {ref!r}")
        elif not (o.done and o.finish_reason) or o.text != ref:
            problems.append(f"prompt {o.prompt}: got {o.text!r} (done={o.done}, finish={o.finish_reason}), "
                            f"alone it is {ref!r}")
        problems += [f"prompt {o.prompt}: 429 with only {n} other requests outstanding (limit {limit})"
                     for n in o.rejections if count_bound and n < limit + running]
    return problems


def summary(outcomes: list[Outcome], wall_s: float) -> dict:
    kept = [o for o in outcomes if not o.dropped and not o.error]
    tokens = sum(o.tokens for o in outcomes)
    ttft = [o.ttft_s for o in kept if o.ttft_s is not None]
    e2e = [o.e2e_s for o in kept if o.e2e_s is not None]
    ms = lambda xs, q: round(1e3 * percentile(xs, q), 1) if xs else None  # noqa: E731
    return {"requests": len(outcomes), "completed": len(kept), "dropped": sum(o.dropped for o in outcomes),
            "errors": sum(bool(o.error) for o in outcomes), "429s": sum(len(o.rejections) for o in outcomes),
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99), "e2e_ms_p50": ms(e2e, 50),
            "e2e_ms_p99": ms(e2e, 99), "tokens": tokens, "wall_s": round(wall_s, 2),
            "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None}


def metric(url: str, name: str) -> float:
    from spd_engine.server.exporter import without_model_name

    m = re.search(rf"^{re.escape(name)} (\S+)$", without_model_name(httpx.get(f"{url}/metrics").text), re.M)
    return float(m.group(1)) if m else float("nan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spd measure serve-load", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=3, help="requests per client and phase")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    p.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue")
    p.add_argument("--max-batch", default="1", help="the server's --max-batch; comma-separated: one run each")
    p.add_argument("--disconnect", type=float, default=0.3, help="drop probability per request in phase 2")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: the model's chat template; completions: plain prompts (models without one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drops and their timing")
    p.add_argument("--json-out", default=None, help="write the report here as JSON")
    p.add_argument("server_args", nargs="*", help="after --: arguments of spd serve (model, stages, ...)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    batches = [int(b) for b in args.max_batch.split(",") if b.strip()]
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 2 or not 0 <= args.disconnect <= 1 \
            or not batches or min(batches) < 1:
        print("serve_load: need clients, requests >= 1, max-tokens >= 2, disconnect in [0, 1], max-batch >= 1",
              file=sys.stderr)
        return 2
    reports = {B: run_server_test(args, B) for B in batches}
    report = reports[batches[0]] if len(batches) == 1 else {"by_max_batch": reports}
    print(json.dumps(report, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if len(batches) > 1:
        print(comparison(reports))
    problems = [f"B={B}: {p}" if len(batches) > 1 else p for B, r in reports.items() for p in r["problems"]]
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


def comparison(reports: dict[int, dict]) -> str:
    """One row per --max-batch: the steady phase's latency percentiles and throughput."""
    first = next(iter(reports.values()))["replies"]
    lines = ["| --max-batch | requests | e2e p50 ms | e2e p99 ms | TTFT p50 ms | tokens/s | replies = alone | "
             f"alone = B={next(iter(reports))}'s alone |", "|---|---|---|---|---|---|---|---|"]
    for B, r in reports.items():
        s = r["phases"]["steady"]
        same = s["completed"] - sum(1 for p in r["problems"] if p.startswith("steady: prompt"))
        lines.append(f"| {B} | {s['requests']} | {s['e2e_ms_p50']} | {s['e2e_ms_p99']} | {s['ttft_ms_p50']} | "
                     f"{s['tokens_per_s']} | {same}/{s['requests']} | "
                     f"{sum(r['replies'][k] == v for k, v in first.items())}/{len(first)} |")
    return "\n".join(lines)


def run_server_test(args: argparse.Namespace, max_batch: int) -> dict:
    """The whole test against one server started with --max-batch `max_batch`: its report."""
    server_args = args.server_args or ["--model", "smollm2-135m"]
    model = server_args[server_args.index("--model") + 1] if "--model" in server_args else "smollm2-135m"
    server = ServerProcess([*server_args, "--max-queue", str(args.max_queue), "--max-batch", str(max_batch)])
    rng = random.Random(args.seed)
    try:
        bodies = [request_body(model, text, args.max_tokens, args.endpoint == "chat")
                  for text in prompts(args.clients * args.requests)]
        alone, wall = run_phase(server.url, bodies, 1, len(bodies), args.max_queue, 0.0, rng)
        refs = {o.prompt: o.text for o in alone}
        report = {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
                  "max_queue": args.max_queue, "max_batch": max_batch, "server_args": server_args,
                  "alone": summary(alone, wall), "phases": {}, "replies": {str(k): v for k, v in refs.items()}}
        problems = [f"alone: {p}" for p in check(alone, refs, args.max_queue, max_batch)]
        phases = (("steady", 0.0), ("disconnect", args.disconnect)) if args.disconnect > 0 else (("steady", 0.0),)
        for name, drop_p in phases:
            cancelled = metric(server.url, 'spd:request_total{outcome="cancelled"}')
            outcomes, wall = run_phase(server.url, bodies, args.clients, args.requests, args.max_queue, drop_p, rng)
            phase = summary(outcomes, wall)
            phase["server_cancelled"] = metric(server.url, 'spd:request_total{outcome="cancelled"}') - cancelled
            report["phases"][name] = phase
            problems += [f"{name}: {p}" for p in check(outcomes, refs, args.max_queue, max_batch)]
            if phase["server_cancelled"] > phase["dropped"]:
                problems.append(f"{name}: the server cancelled {phase['server_cancelled']} requests, "
                                f"only {phase['dropped']} clients went away")
            if metric(server.url, "spd:num_requests_waiting") != 0 or httpx.get(f"{server.url}/health").status_code != 200:
                problems.append(f"{name}: queue not empty or server unhealthy afterwards")
        report["server_exit_code"] = server.terminate()
        if report["server_exit_code"] != 0:
            problems.append(f"server exit code {report['server_exit_code']} after SIGTERM")
        report["problems"] = problems
    finally:
        server.kill()
    return report
