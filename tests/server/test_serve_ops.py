"""`spd serve` operated as a service, each against a real server process on 127.0.0.1:
`--max-queue 0` serves one request at a time; a stage rank stopped with SIGSTOP fails the request
in flight naming it within the stall deadline and leaves no process behind; a drain answers new
requests 503 `draining` and, past its deadline, ends the stream with an error event and [DONE] and
the queued requests with 503s (exit 1); Ctrl-C or SIGTERM to the process group drains to exit 0
without a traceback; JSON nested too deeply is a 400; X-Request-Id, --api-key, Retry-After, the
request log line and the model_name label of /metrics."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from spd_engine.engine.runtime.launch import spd_command
from spd_engine.server.process import ServerProcess, group_members

pytestmark = pytest.mark.multiproc
TINY = "random:tiny-llama"
# the queueing, stall and drain tests need a 480-token request still running seconds later on any host:
# one token per entry (--suffix-run 1) and every stage step at least 10 ms long (480 tokens: at least 4.8 s);
# one request in the pipeline at a time (--max-batch 1): the queue and drain checks count what waits
TINY_ARGS = ["--model", TINY, "--stages", "2", "--threads", "1", "--capacity", "512", "--prefill-chunk", "16",
             "--suffix-run", "1", "--stage-ms", "10", "--max-batch", "1"]


def post(server: ServerProcess, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={"model": TINY, **body}, timeout=120, **kw)


def ps_group(pgid: int) -> list[str]:
    """`ps` lines of the processes still in the group (zombies excluded: they are gone)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1][0] != "Z"]


class Stream:
    """A streamed completion read on a thread: each line with its arrival time."""

    def __init__(self, server: ServerProcess, body: dict, headers: dict | None = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.error: BaseException | None = None
        body = {"model": TINY, "stream": True, **body}
        self.thread = threading.Thread(target=self._run, args=(server, body, headers or {}), daemon=True)
        self.thread.start()

    def _run(self, server, body, headers) -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=headers,
                              timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
                        self.first.set()
        except httpx.HTTPError as err:
            self.error = err
        finally:
            self.first.set()

    def join(self, timeout: float = 120) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return [line for _, line in self.lines]


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]


def test_max_queue_0_serves_requests_one_by_one_and_429s_carry_retry_after():
    server = ServerProcess([*TINY_ARGS, "--max-queue", "0"])
    try:
        for k in range(3):  # before: every request 429 "0 requests waiting (limit 0)" on an idle server
            r = post(server, {"prompt": [5 + k, 6], "max_tokens": 4})
            assert r.status_code == 200, r.text
        stream = Stream(server, {"prompt": [4, 5], "max_tokens": 200})
        assert stream.first.wait(60)
        busy = post(server, {"prompt": [9], "max_tokens": 2})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"
        stream.join()
        assert post(server, {"prompt": [9], "max_tokens": 2}).status_code == 200
    finally:
        assert server.close() == 0, server.stderr()[-3000:]


def test_a_stopped_stage_rank_fails_the_request_naming_it_and_nothing_survives():
    """SIGSTOP (a hung rank): before, the stream was silent for --timeout (60 s) while /health said
    ok, the server exited only at its hard exit and left the stopped rank and the resource tracker
    running under PID 1."""
    server = ServerProcess(["--model", TINY, "--stages", "3", "--threads", "1", "--capacity", "512",
                            "--stall-timeout", "3", "--timeout", "60", "--stage-ms", "10"])
    try:
        stream = Stream(server, {"prompt": [4, 5], "max_tokens": 480})
        assert stream.first.wait(60)
        ranks = server.spawned()
        assert len(ranks) == 3, ranks
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        health = None
        while time.monotonic() - t0 < 15 and health != 503:
            health = httpx.get(f"{server.url}/health").status_code
            time.sleep(0.2)
        assert health == 503, "/health did not report the stall"
        lines = stream.join(30)
        failed_after = stream.lines[-1][0] - t0
        error = events(lines)[-1]["error"]
        assert lines[-1] == "data: [DONE]" and error["code"] == "rank_stalled", lines[-3:]
        assert f"(pid {stopped}) is stopped" in error["message"] and re.search(r"stage rank \d", error["message"])
        assert failed_after < 3 + 2, failed_after  # within the stall deadline (plus the watch's poll)
        code = server.wait(30)
        assert code not in (0, None), server.stderr()[-3000:]
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while ps_group(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ps_group(server.proc.pid) == [], "processes left behind"
    finally:
        server.kill()


def test_drain_answers_503_then_past_its_deadline_ends_every_held_request_cleanly():
    """Before: new requests after SIGTERM got 'connection refused'; past --drain-timeout the stream
    was cut without an error event or [DONE], the queued requests got a plain-text 500 and the
    server exited 0. Four requests of 480 tokens are held (three streams, then one plain); the
    2 s deadline ends the one running then (a stream: 200, an error event, [DONE]) and answers
    the ones still queued 503; those before it completed (on a slow host the first may have)."""
    server = ServerProcess([*TINY_ARGS, "--max-queue", "4", "--drain-timeout", "2"])

    def admitted(n: int) -> None:  # wait until n requests were admitted: they queue in the order they were sent
        # (admitted, not waiting: on a slow host the first may finish before the last is queued)
        deadline = time.monotonic() + 30
        while sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                  if line.startswith("spd:request_admitted_total")) < n:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    try:
        streams = [Stream(server, {"prompt": [4, 5], "max_tokens": 480})]
        assert streams[0].first.wait(60)
        for k in range(2):
            streams.append(Stream(server, {"prompt": [7, k], "max_tokens": 480}))
            admitted(k + 2)
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(post(server, {"prompt": [8], "max_tokens": 480})),
                                  daemon=True)
        waiter.start()
        admitted(4)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = post(server, {"prompt": [1], "max_tokens": 2})  # still listening
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"] == "1"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        outcomes = []
        for stream in streams:
            lines = stream.join(60)
            if stream.status == 200:
                assert lines[-1] == "data: [DONE]", lines[-3:]
                last = events(lines)[-1]
                outcomes.append("ended" if "error" in last else last["choices"][0]["finish_reason"])
                if "error" in last:
                    assert last["error"]["code"] == "unavailable" and "drain deadline" in last["error"]["message"]
            else:
                body = json.loads(lines[0])
                assert stream.status == 503 and body["error"]["type"] == "server_error", lines
                outcomes.append("503")
        waiter.join(60)
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "unavailable"
        # in order: completed ones, the one the deadline ended mid-stream, then 503s
        assert outcomes.count("ended") == 1 and outcomes == sorted(outcomes, key=["length", "ended", "503"].index)
        assert server.wait(30) == 1, server.stderr()[-3000:]
        assert "Traceback" not in server.stderr()
        assert server.leftovers() == []
    finally:
        server.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_process_group_drains_to_exit_0(sig):
    """Ctrl-C in a terminal and `timeout`/systemd/Kubernetes send the signal to every process of the
    group. Before: tracebacks from every rank and exit -2, or 'pipeline failed ... rank 1: exit
    code -15' and exit 1."""
    server = ServerProcess(TINY_ARGS)
    try:
        stream = Stream(server, {"prompt": [4, 5], "max_tokens": 200})
        assert stream.first.wait(60)
        os.killpg(server.proc.pid, sig)
        lines = stream.join(60)
        assert lines[-1] == "data: [DONE]" and events(lines)[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(60) == 0, server.stderr()[-3000:]
        assert "Traceback" not in server.stderr() and "failed" not in server.stderr(), server.stderr()[-3000:]
        assert server.leftovers() == []
    finally:
        server.kill()


@pytest.fixture(scope="module")
def keyed():
    server = ServerProcess([*TINY_ARGS, "--api-key", "sekret", "--log-level", "info"])
    yield server
    assert server.close() == 0, server.stderr()[-3000:]


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key_request_id_and_log_line(keyed):
    assert post(keyed, {"prompt": [5], "max_tokens": 2}).status_code == 401
    bad = post(keyed, {"prompt": [5], "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed.base_url}/models").status_code == 401
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # probes need no key
    r = post(keyed, {"prompt": [5, 6], "max_tokens": 3}, headers={**AUTH, "X-Request-Id": "req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
    made = post(keyed, {"prompt": [5, 6], "max_tokens": 3}, headers=AUTH).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    deadline = time.monotonic() + 10
    while "request req-42" not in keyed.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in keyed.stderr().splitlines() if "request req-42" in line)
    assert re.search(r"INFO spd.serve: request req-42 /v1/completions 200 prompt_tokens=2 completion_tokens=3 "
                     r"ttft=\d+\.\d{3}s total=\d+\.\d{3}s finish=length$", line), line


def test_json_nested_too_deeply_is_a_400_and_metrics_carry_the_model_name(keyed):
    deep = b"[" * 100_000 + b"]" * 100_000  # before: RecursionError, a plain-text 500, not counted
    r = httpx.post(f"{keyed.base_url}/completions", content=deep,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert post(keyed, {"prompt": [5, 6], "max_tokens": 3}, headers=AUTH).status_code == 200
    text = httpx.get(f"{keyed.url}/metrics").text
    assert f'spd:request_total{{model_name="{TINY}",outcome="bad_request"}}' in text
    assert re.search(rf'^spd:request_success_total\{{finished_reason="length",model_name="{re.escape(TINY)}"\}} '
                     r'[1-9]', text, re.M)


def test_a_body_over_the_limit_is_413_before_it_is_parsed(keyed):
    big = json.dumps({"model": TINY, "prompt": "x" * (3 << 20)}).encode()
    r = httpx.post(f"{keyed.base_url}/completions", content=big,
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused once the limit is passed
        for _ in range(64):
            yield b" " * (64 << 10)

    r = httpx.post(f"{keyed.base_url}/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


@pytest.mark.slow
def test_generate_ctrl_c_exits_130_with_one_line_and_nothing_left():
    proc = subprocess.Popen([*spd_command(), "generate", *TINY_ARGS,
                             "--prompt", "hello", "--max-new-tokens", "480"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.read(1)  # the first generated id
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "spd generate: interrupted", err
        deadline = time.monotonic() + 10
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group_members(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_nothing_outlives_a_server_killed_with_sigkill():
    """No handler runs on SIGKILL: the forkserver the ranks are forked from leaves when the server is
    gone, and the ranks die because they asked the kernel to kill them when it ends (PR_SET_PDEATHSIG);
    the tokenizer process asked the same of the server, and the resource tracker follows."""
    server = ServerProcess(TINY_ARGS)
    try:
        assert post(server, {"prompt": [5, 6], "max_tokens": 4}).status_code == 200
        assert len(server.spawned()) == 2
        os.kill(server.proc.pid, signal.SIGKILL)
        assert server.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while ps_group(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ps_group(server.proc.pid) == [], "processes left behind"
    finally:
        server.kill()
