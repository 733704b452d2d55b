"""Prometheus metrics of `spd serve` (prometheus_client, one registry per server).

Names follow vLLM's where one exists (`vllm:` -> `spd:`): request outcomes, queue length, time to
first token (from arrival, queue wait included), inter-token latency, end-to-end latency, prompt
and generation tokens, and the speculative-decoding counters (`spec_decode_num_draft_tokens` =
verified drafts, `spec_decode_num_accepted_tokens`). SPD's own: ticks, rejections, pooled EAL and
acceptance, branch points and saves, per-stage compute and steps, driver timers and the per-tick
driver slack; with --max-batch, the stage utilization (overall and per stage) and rows per stage step. Every
sample carries vLLM's `model_name` label (the served model name), added at
exposition time, so dashboards made for vLLM can select and join on it; vLLM's per-request
families are here too: `request_success_total{finished_reason}` (stop, length, abort),
`request_prompt_tokens`, `request_generation_tokens`, `request_inference_time_seconds`,
`request_prefill_time_seconds` and `request_decode_time_seconds`. `request_admitted_total{latency}`
counts the requests admitted to the queue by latency class (batch, critical); `cancel_tokens_after` and
`cancel_seconds_after` how promptly a cancelled request in the pipeline ended. As vLLM's, the
exposition has no `_created` series.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from spd_engine.engine.protocol.batch_policy import LATENCY_CLASSES
from spd_engine.engine.protocol.metrics import GenerationResult

OUTCOMES = ("stop", "length", "cancelled", "timeout", "error", "bad_request", "queue_full", "unavailable")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
SLACK_BUCKETS = (-0.05, -0.02, -0.01, -0.005, -0.002, 0.0, 0.002, 0.005, 0.01, 0.02, 0.05)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}  # vLLM's finished_reason


def without_model_name(text: str) -> str:
    """The exposition text with the model_name label taken out (`name{model_name="m"} 1` -> `name 1`):
    what a client that serves one model matches against."""
    return re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", text).replace(",}", "}").replace("{} ", " ")


class ModelNameLabel(Collector):
    """Every sample of `registry` with the label model_name=NAME added (name None: as it is), less the
    `_created` series: vLLM's exporter has none, and prometheus_client's switch for them is one global
    of the process (read at each collection), so they are left out here, for this registry alone."""

    def __init__(self, registry: CollectorRegistry, name: str | None) -> None:
        self.registry, self.name = registry, name

    def collect(self):
        for family in self.registry.collect():
            created = family.name + "_created"
            label = {} if self.name is None else {"model_name": self.name}
            family.samples = [s._replace(labels={**label, **s.labels}) for s in family.samples if s.name != created]
            yield family


def _utilization(stage_counts: Callable[[], object]):
    """The pipeline's Utilization since start (engine/protocol/batch_schedule.py), None before any tick."""
    counts = stage_counts()
    return counts.utilization() if counts is not None and counts.ticks else None


class StageUtilization(Collector):
    """`spd:stage_utilization_by_stage{stage}`: each stage's share of ticks that computed a live row."""

    def __init__(self, n: int, stage_counts: Callable[[], object]) -> None:
        self.n, self.stage_counts = n, stage_counts

    def collect(self):
        u = _utilization(self.stage_counts)
        family = GaugeMetricFamily("spd:stage_utilization_by_stage", "Per stage: share of ticks that computed "
                                   "a live row, over every run of --max-batch requests since start", labels=["stage"])
        for s in range(self.n):
            family.add_metric([str(s)], u.per_stage[s] if u is not None else 0.0)
        yield family


class ServeMetrics:
    def __init__(self, n: int, waiting: Callable[[], int], running: Callable[[], int],
                 model_name: str | None = None, stage_counts: Callable[[], object] = lambda: None) -> None:
        self.n = n
        self.model_name = model_name
        self._totals = dict.fromkeys(("ticks", "decode", "drafts", "accepted"), 0)  # for the pooled gauges
        r = self.registry = CollectorRegistry()
        self.requests = Counter("spd:request", "Finished or refused requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        # its own counter, so request_total{outcome} keeps its one label (and dashboards their queries)
        self.admitted_by_class = Counter("spd:request_admitted", "Requests admitted to the queue, by latency class",
                                         ["latency"], registry=r)
        for c in LATENCY_CLASSES:
            self.admitted_by_class.labels(latency=c)
        self.success = Counter("spd:request_success", "Requests that went through the pipeline, by vLLM's "
                               "finished_reason", ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.success.labels(finished_reason=reason)
        # how promptly a cancel (client gone, deadline) ends a request in the pipeline: it ends at the next token
        self.cancel_tokens = Histogram("spd:cancel_tokens_after", "Per cancelled request in the pipeline: tokens "
                                       "committed after the cancel", buckets=(0, 1, 2, 4, 8, 16, 64), registry=r)
        self.cancel_time = Histogram("spd:cancel_seconds_after", "Per cancelled request in the pipeline: the cancel "
                                     "to the request's end", buckets=ITL_BUCKETS, registry=r)
        self.request_prompt = Histogram("spd:request_prompt_tokens", "Prompt tokens per request",
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation = Histogram("spd:request_generation_tokens", "Generated tokens per request",
                                            buckets=TOKEN_BUCKETS, registry=r)
        self.inference_time = Histogram("spd:request_inference_time_seconds", "Entering the pipeline to the "
                                        "last token", buckets=E2E_BUCKETS, registry=r)
        self.prefill_time = Histogram("spd:request_prefill_time_seconds", "Entering the pipeline to the first "
                                      "token", buckets=E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("spd:request_decode_time_seconds", "First to last token",
                                     buckets=E2E_BUCKETS, registry=r)
        Gauge("spd:num_requests_waiting", "Requests in the queue", registry=r).set_function(waiting)
        Gauge("spd:num_requests_running", "Requests in the pipeline (up to --max-batch)", registry=r).set_function(running)
        self.ttft = Histogram("spd:time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("spd:inter_token_latency_seconds", "Between consecutive tokens of a reply",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("spd:e2e_request_latency_seconds", "Arrival to the last token", buckets=E2E_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("spd:request_queue_time_seconds", "Arrival to entering the pipeline",
                                    buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("spd:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("spd:generation_tokens", "Tokens of the replies", registry=r)
        self.drafts = Counter("spd:spec_decode_num_draft_tokens", "Verified drafts", registry=r)
        self.accepted = Counter("spd:spec_decode_num_accepted_tokens", "Accepted drafts", registry=r)
        self.rejections = Counter("spd:spec_decode_num_rejections", "Rejections followed by more tokens",
                                  registry=r)
        self.branch_points = Counter("spd:spec_decode_branch_points", "Verified branch points (--branches W > 1)",
                                     registry=r)
        self.branch_saves = Counter("spd:spec_decode_branch_saves", "Branch points a candidate other than the "
                                    "first one held the target's token", registry=r)
        self.ticks = Counter("spd:spec_decode_ticks", "Decode ticks (fill and refill included)", registry=r)
        self.decode_tokens = Counter("spd:spec_decode_decode_tokens", "Tokens committed by decode ticks", registry=r)
        self.eal = Gauge("spd:spec_decode_eal", "Pooled EAL since start: n * decode tokens / ticks", registry=r)
        self.alpha = Gauge("spd:spec_decode_draft_acceptance_rate", "Pooled accepted / verified drafts",
                           registry=r)
        self.stage_compute = Counter("spd:stage_compute_seconds", "Stage compute time", ["stage"], registry=r)
        self.stage_steps = Counter("spd:stage_steps", "Messages a stage computed", ["stage"], registry=r)
        for s in range(n):  # every stage's series from the start: with --max-batch they count at a run's end
            self.stage_compute.labels(stage=str(s))
            self.stage_steps.labels(stage=str(s))
        # several requests in the pipeline (--max-batch): engine/runtime/batch_driver.py StageCounts
        Gauge("spd:stage_utilization", "Share of stage-ticks that computed a live row, over every run of "
              "--max-batch requests since start", registry=r).set_function(
            lambda: u.overall if (u := _utilization(stage_counts)) is not None else 0.0)
        Gauge("spd:rows_per_stage_step", "Token rows per stage step (a step carries one row per request "
              "with a token there), since start", registry=r).set_function(
            lambda: u.rows_per_step if (u := _utilization(stage_counts)) is not None else 0.0)
        r.register(StageUtilization(n, stage_counts))
        self.driver = Counter("spd:driver_seconds", "Driver time by part (pdm, verify, wait, send)", ["part"],
                              registry=r)
        self.cpu_waits = Counter("spd:stall_cpu_waits", "Jobs in the pipeline that committed no token for the "
                                 "stall deadline while their ranks waited for a CPU (not failed; server/stall.py)",
                                 registry=r)
        self.slack = Histogram("spd:driver_slack_seconds_per_tick", "Per request: slowest stage's compute "
                               "per tick minus the driver's pdm + verify + send per tick", buckets=SLACK_BUCKETS,
                               registry=r)

    def outcome(self, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(outcome=outcome).inc()

    def admitted(self, latency: str) -> None:
        """A request admitted to the queue (its latency class: batch_policy.LATENCY_CLASSES)."""
        self.admitted_by_class.labels(latency=latency).inc()

    def request_done(self, job, res: GenerationResult) -> None:
        """One request that went through the pipeline (job: serve_engine.Job)."""
        self.outcome(job.finish_reason)
        if job.finish_reason in FINISHED:
            self.success.labels(finished_reason=FINISHED[job.finish_reason]).inc()
        if (after := job.after_cancel()) is not None:
            self.cancel_time.observe(after[0])
            self.cancel_tokens.observe(after[1])
        times = job.token_times
        self.request_prompt.observe(len(job.req.prompt_ids))
        self.request_generation.observe(len(times))
        if job.started is not None:
            self.queue_time.observe(job.started - job.arrival)
        if times:
            self.ttft.observe(times[0] - job.arrival)
            self.e2e.observe(times[-1] - job.arrival)
            self.decode_time.observe(times[-1] - times[0])
            if job.started is not None:
                self.prefill_time.observe(times[0] - job.started)
                self.inference_time.observe(times[-1] - job.started)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        self.prompt_tokens.inc(len(job.req.prompt_ids))
        self.generation_tokens.inc(len(times))
        self._spd(res)

    def _spd(self, res: GenerationResult) -> None:
        self.drafts.inc(res.verified)
        self.accepted.inc(res.accepted)
        self.rejections.inc(res.rejections)
        self.branch_points.inc(res.branch_points)
        self.branch_saves.inc(res.branch_saves)
        self.ticks.inc(res.ticks)
        self.decode_tokens.inc(res.decode_tokens)
        t = self._totals
        for key, value in (("ticks", res.ticks), ("decode", res.decode_tokens), ("drafts", res.verified),
                           ("accepted", res.accepted)):
            t[key] += value
        if t["ticks"]:
            self.eal.set(self.n * t["decode"] / t["ticks"])
        if t["drafts"]:
            self.alpha.set(t["accepted"] / t["drafts"])
        self.stages_done(res.stages)
        for part, seconds in res.driver.items():
            self.driver.labels(part=part).inc(seconds)
        slack = res.breakdown_ms_per_tick().get("driver_slack_ms")
        if slack is not None:
            self.slack.observe(slack / 1e3)

    def stages_done(self, stages: list[dict]) -> None:
        """Each stage's statistics of a request (one at a time) or of a run of several (--max-batch,
        whose requests' results carry none when they end)."""
        for s, st in enumerate(stages):
            self.stage_compute.labels(stage=str(s)).inc(st.get("compute_s", 0.0))
            self.stage_steps.labels(stage=str(s)).inc(st.get("messages", 0.0))

    def exposition(self) -> bytes:
        labelled = CollectorRegistry()
        labelled.register(ModelNameLabel(self.registry, self.model_name))
        return generate_latest(labelled)
