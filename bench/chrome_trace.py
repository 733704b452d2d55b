"""The tick timeline as a Chrome trace (Trace Event Format JSON), which Perfetto and chrome://tracing open.

Input is a traced GenerationResult.trace (bench/timeline.py describes it): driver events
(tick, what, t0, t1) and per-stage (receive start, compute start, compute end) triples in
perf_counter seconds, one clock for the processes of a host. Each rank is one thread of one
process: the driver's pdm / verify / send work, each stage's receive wait and compute, as
complete ("X") events in microseconds from the first event.
"""
from __future__ import annotations

import json
from pathlib import Path


def trace_events(trace: dict, label: str = "spd") -> list[dict]:
    """Trace Event Format events of one request's trace."""
    starts = [e[2] for e in trace["driver"]] + [t[0] for lane in trace["stages"] for t in lane]
    if not starts:
        raise ValueError("the trace has no events")
    t_ref = min(starts)
    us = lambda t: round(1e6 * (t - t_ref), 3)  # noqa: E731
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": label}},
              {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "driver"}}]
    for tick, what, t0, t1 in trace["driver"]:
        events.append({"name": what, "cat": "driver", "ph": "X", "pid": 0, "tid": 0, "ts": us(t0),
                       "dur": us(t1) - us(t0), "args": {"tick": tick}})
    for s, lane in enumerate(trace["stages"]):
        tid = s + 1
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"stage {s}"}})
        for i, (r0, c0, c1) in enumerate(lane):
            events.append({"name": "wait", "cat": "stage", "ph": "X", "pid": 0, "tid": tid, "ts": us(r0),
                           "dur": us(c0) - us(r0), "args": {"message": i}})
            events.append({"name": "compute", "cat": "stage", "ph": "X", "pid": 0, "tid": tid, "ts": us(c0),
                           "dur": us(c1) - us(c0), "args": {"message": i}})
    return events


def write_chrome_trace(trace: dict, path: str | Path, label: str = "spd") -> Path:
    """Write the trace JSON ({"traceEvents": [...]}) to `path`."""
    doc = {"traceEvents": trace_events(trace, label), "displayTimeUnit": "ms"}
    Path(path).write_text(json.dumps(doc))
    return Path(path)
