"""A real `spd serve` stream alone and beside a competing neighbour on the same host: the gaps
between its tokens, the CPU and run-queue time of its spawned processes, and what its stall
watch made of it.

    spd measure serve-neighbour --duration 60 -- --model smollm2-135m --stages 4 --threads 1
    spd measure serve-neighbour --neighbour busy -- --model smollm2-135m --stages 4 --threads 1

Starts the server (arguments after `--`; it leads its own session, as `spd serve` from a shell or
a service does), streams `--repeats` greedy completions alone, then starts the neighbour and
streams for `--duration` seconds, then streams `--repeats` alone again. Neighbours:
`gil-threads` is `--processes` processes of `--threads-each` Python threads each running small
one-thread torch products (threads that hand one interpreter lock back and forth, as a test
runner or a data loader in Python does); `busy` is `--processes` one-thread busy loops. Both end
themselves when this process is gone, and the phase beside them starts once each has said it is
running. Per phase: streams, the largest time to a first token, the largest gap between two
tokens after it (median and max over streams), the stream time, the CPU seconds and run-queue
seconds per wall second of the server's spawned processes (its stage ranks and its tokenizer
process, all together; /proc, server/stall.py), and the requests that failed (their error code,
e.g. `rank_stalled`); a failed request ends the run (the server fails with it), and the exit
status is then 1. Linux only.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from spd_engine.server.process import ServerProcess
from spd_engine.server.stall import sample
from spd_engine.tools.cli import HelpFormatter

# a neighbour process: T threads of small one-thread products; says "running", ends when its parent is gone
_GIL_THREADS = """
import os, sys, threading, torch
torch.set_num_threads(1)
threads, parent = int(sys.argv[1]), int(sys.argv[2])
a, w = torch.randn(1, 576), torch.randn(576, 1536)
def loop():
    while os.getppid() == parent:
        for _ in range(100):
            (a @ w).sum()
ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads - 1)]
[t.start() for t in ts]
print("running", flush=True)
loop()
"""
_BUSY = """
import os, sys
parent = int(sys.argv[2])
print("running", flush=True)
while os.getppid() == parent:
    for _ in range(100000):
        pass
"""


def start_neighbour(kind: str, processes: int, threads: int) -> list[subprocess.Popen]:
    """The neighbour's processes, each already running its load (torch's import takes a second or two)."""
    script = _GIL_THREADS if kind == "gil-threads" else _BUSY
    procs = [subprocess.Popen([sys.executable, "-c", script, str(threads), str(os.getpid())], stdout=subprocess.PIPE,
                              text=True) for _ in range(processes)]
    for p in procs:
        if p.stdout.readline().strip() != "running":
            raise RuntimeError(f"a neighbour process exited {p.wait()} before it ran")
    return procs


def stream(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: time to its first chunk, gaps between the later chunks (s), the
    time to its last chunk, and the error code of a request that failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    times, error = [], None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code == 200:
                error = _read(r, times)
            else:
                r.read()
                error = _error_code(r.text) or f"HTTP {r.status_code}"
    except httpx.TransportError:  # the server exited (a failed engine ends the server)
        error = "server gone"
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"first_token_s": times[0] - t0 if times else None, "largest_gap_s": max(gaps) if gaps else None,
            "total_s": times[-1] - t0 if times else None, "error": error}


def _error_code(text: str) -> str | None:
    """The `error.code` of an OpenAI-style error body, if it is one."""
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return None
    return (error.get("code") or "error") if isinstance(error, dict) else None


def _read(r: httpx.Response, times: list[float]) -> str | None:
    """Append the arrival time of each data chunk; the error code of an error event, if one came."""
    error = None
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        code = _error_code(line.removeprefix("data: "))
        if code is not None:
            error = code
            continue
        times.append(time.monotonic())
    return error


class RankUse:
    """CPU and run-queue seconds of the given processes between start() and stop()."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def start(self) -> None:
        self.t0, self.a = time.monotonic(), [sample(p) for p in self.pids]

    def stop(self) -> dict:
        dt, b = time.monotonic() - self.t0, [sample(p) for p in self.pids]
        if not b or any(y.state is None for y in b):  # none found, or one ended: its counts went with it
            return {"cpu_per_s": None, "run_queue_per_s": None}
        return {"cpu_per_s": sum(y.cpu_s - x.cpu_s for x, y in zip(self.a, b)) / dt,
                "run_queue_per_s": sum(y.wait_s - x.wait_s for x, y in zip(self.a, b)) / dt}


def _stat(values: list, f) -> float | None:
    values = [v for v in values if v is not None]
    return f(values) if values else None


def phase(name: str, server: ServerProcess, args: argparse.Namespace, model: str, until=None, count=None) -> dict:
    use = RankUse(server.spawned())
    use.start()
    runs = []
    while (count is not None and len(runs) < count) or (until is not None and time.monotonic() < until):
        runs.append(stream(server.url, model, args.prompt, args.max_tokens))
        if runs[-1]["error"]:  # a failed request fails the engine: the server is ending
            break
    gaps = [r["largest_gap_s"] for r in runs]
    return {"phase": name, "streams": len(runs), "first_token_max_s": _stat([r["first_token_s"] for r in runs], max),
            "largest_gap_median_s": _stat(gaps, statistics.median), "largest_gap_max_s": _stat(gaps, max),
            "total_median_s": _stat([r["total_s"] for r in runs], statistics.median),
            "failed": [r["error"] for r in runs if r["error"]], **use.stop()}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spd measure serve-neighbour", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--neighbour", choices=("gil-threads", "busy"), default="gil-threads",
                   help="gil-threads: processes of Python threads running small torch products; busy: busy loops")
    p.add_argument("--processes", type=int, default=2, help="neighbour processes")
    p.add_argument("--threads-each", type=int, default=3, help="threads per gil-threads process")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of streaming beside the neighbour")
    p.add_argument("--repeats", type=int, default=3, help="streams alone, before and after")
    p.add_argument("--prompt", default="Count from one to fifty:", help="the streamed completion's prompt")
    p.add_argument("--max-tokens", type=int, default=60, help="completion tokens per stream")
    p.add_argument("--json-out", default=None, help="write the report here as JSON")
    p.add_argument("serve_args", nargs="*", help="after --: arguments of spd serve (model, stages, ...)")
    return p


def model_name(serve_args: list[str]) -> str:
    """The --model of spd serve's arguments (`--model M` or `--model=M`)."""
    for i, a in enumerate(serve_args):
        if a.startswith("--model="):
            return a.split("=", 1)[1]
        if a == "--model" and i + 1 < len(serve_args):
            return serve_args[i + 1]
    raise ValueError("name the model after --: spd measure serve-neighbour -- --model smollm2-135m ...")


def run_phases(server: ServerProcess, args: argparse.Namespace, model: str) -> list[dict]:
    """Alone, beside the neighbour, alone again; a phase with a failed request is the last."""
    report = [phase("alone (before)", server, args, model, count=args.repeats)]
    if report[-1]["failed"]:
        return report
    neighbour = start_neighbour(args.neighbour, args.processes, args.threads_each)
    try:
        report.append(phase(f"beside {args.processes} x {args.neighbour}", server, args, model,
                            until=time.monotonic() + args.duration))
    finally:
        for p in neighbour:
            p.kill()
            p.wait()
    if not report[-1]["failed"]:
        report.append(phase("alone (after)", server, args, model, count=args.repeats))
    return report


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so that the server (its own session) is closed on the way out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.processes < 1 or args.threads_each < 1 or args.duration <= 0 or args.repeats < 1 or args.max_tokens < 1:
        raise ValueError("--processes, --threads-each, --repeats and --max-tokens must be >= 1, --duration > 0")
    model = model_name(args.serve_args)
    previous = signal.signal(signal.SIGTERM, _terminate)
    server = ServerProcess(args.serve_args)
    try:
        report = run_phases(server, args, model)
    finally:
        server.close()
        signal.signal(signal.SIGTERM, previous)
    print("| phase | streams | first token, max s | largest gap after it, median (max) s | stream s (median) "
          "| spawned processes' CPU s/s | run-queue s/s | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report:
        gap = "-" if r["largest_gap_max_s"] is None else f"{r['largest_gap_median_s']:.2f} ({r['largest_gap_max_s']:.2f})"
        print(f"| {r['phase']} | {r['streams']} | {_num(r['first_token_max_s'])} | {gap} | {_num(r['total_median_s'])} "
              f"| {_num(r['cpu_per_s'])} | {_num(r['run_queue_per_s'])} | {', '.join(r['failed']) or '-'} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"argv": argv, "phases": report}, f, indent=1)
    failed = any(r["failed"] for r in report)
    if failed:
        said = [line for line in server.stderr().splitlines() if "unhealthy" in line or " ERROR " in line]
        print(f"a request failed; the server exited {server.proc.returncode}:\n" + "\n".join(said[:2]))
    return 1 if failed else 0
