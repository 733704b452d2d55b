"""Cost model: predict SPD tick time, decode tokens/s and speedup, and the resource-matched
alternatives (tensor parallel, plain pipeline parallel, TP-inside-node x SPD hybrids), from
measured inputs. Pure arithmetic: no torch, no torch.distributed. Times are milliseconds.

SPD is a timed event graph (docs/design.md 3.3). Stage p starts token e when its input arrived and it
finished token e-1; the driver at tick t starts the PDM when it has posted the previous token
and the anchors of tick t-1 that its rows need have arrived, then verifies the exit of the
oldest token (in series: the next token for stage 0 is known only after verification) and
sends the next token. `simulate_spd` evaluates these max-plus recurrences tick by tick with
seeded accept draws (rejections refill the pipeline for n-1 ticks without verification).
With every draft accepted the tick converges to the largest cycle mean, `spd_cycles`:
  stage p:            read its input + c_p + its send posts
  driver:             PDM + verify + posts + reads       (co-located: + c_0)
  verify loop:        (h_tok + sum c + (n-1) h_act + h_exit + verify) / n
  anchor loop via p:  (h_tok + c_0..c_p + p h_act + h_anchor + PDM + verify) / (p + 2)
(plus the per-message post and read costs on each path). The first-order rule "tick =
max(slowest stage, driver work)" is the first two lines; the loops add the hop latencies.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# int64 [kind, position, epoch, token] ahead of every payload (docs/design.md 3.4), plus the send time
# the tick replay stamps for its hop diagnostics
HEADER_BYTES = 40


def message_bytes(hidden: int, dtype_bytes: int, anchors: int) -> dict[str, int]:
    """Wire sizes of SPD's per-tick messages."""
    row = hidden * dtype_bytes
    return {"token": HEADER_BYTES, "activation": HEADER_BYTES + row,
            "anchors": HEADER_BYTES + anchors * row, "exit": HEADER_BYTES + (1 + anchors) * row}


def eal_from_alpha(n: int, alpha: float) -> float:
    """Equivalent accept length n / (1 + (n-1)(1-alpha)) (docs/design.md 3.3): the steady state."""
    return n / (1 + (n - 1) * (1 - alpha))


def eal_for_request(n: int, alpha: float, tokens: int) -> float:
    """Expected EAL of one request that commits `tokens` (N >= 2) tokens: n (N-1) / ticks with
    ticks = (N-1) + (n-1)(1 + R) (engine/schedule.py decode_ticks) and R = (N-2)(1-alpha) expected
    rejections followed by a token. The initial fill costs n-1 ticks whatever alpha is, so short
    requests fall below `eal_from_alpha`, which this approaches as N grows."""
    if tokens < 2 or not 0 <= alpha <= 1:
        raise ValueError(f"need tokens >= 2 and alpha in [0, 1], got tokens={tokens}, alpha={alpha}")
    ticks = (tokens - 1) + (n - 1) * (1 + (tokens - 2) * (1 - alpha))
    return n * (tokens - 1) / ticks


# ---------------------------------------------------------------- inputs

def _by_n(value, what: str) -> dict[int, float] | float:
    if isinstance(value, dict):
        return {int(k): float(v) for k, v in value.items()}
    if not isinstance(value, (int, float)):
        raise ValueError(f"profile: {what} must be a number or an object keyed by n, got {value!r}")
    return float(value)


def note(notes: list[str], text: str) -> None:
    """Add a note once."""
    if text not in notes:
        notes.append(text)


def interp_by_n(table: dict[int, float] | float, n: int, what: str, notes: list[str]) -> float:
    """Linear in n between measured points; held constant outside them (noted)."""
    if not isinstance(table, dict):
        return table
    keys = sorted(table)
    if n in table:
        return table[n]
    if n < keys[0] or n > keys[-1]:
        note(notes, f"{what} held constant outside the measured n = {keys[0]}..{keys[-1]}")
        return table[keys[0] if n < keys[0] else keys[-1]]
    lo = max(k for k in keys if k < n)
    hi = min(k for k in keys if k > n)
    return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def _stage_table(d: dict, key: str) -> dict[int, tuple[float, ...]]:
    """A profile's {n: [ms per stage]} table, checked: n entries each, all >= 0."""
    table = {int(k): tuple(float(x) for x in v) for k, v in d.get(key, {}).items()}
    for n, times in table.items():
        if len(times) != n or min(times) < 0:
            raise ValueError(f"profile: {key}[{n}] must have {n} entries >= 0, got {list(times)}")
    return table


@dataclass(frozen=True)
class Profile:
    """Measured compute (schema "spd-profile/1", see docs/benchmarks.md)."""

    name: str
    layer_ms: tuple[float, ...]  # per layer, whole layer on one device, batch-1 decode
    pdm_ms: dict[int, float] | float  # PDM forward per tick (grows with n: n+1 rows)
    verify_ms: float  # final norm + LM head + argmax / sampling
    hidden: int
    dtype_bytes: int = 2
    anchors: int = 1
    stage_fixed_ms: float = 0.0  # per stage per tick (launch, embedding), also paid once by AR
    driver_fixed_ms: float = 0.0  # driver host work per tick besides PDM and verify, in series with the PDM
    stage_ms: dict[int, tuple[float, ...]] = field(default_factory=dict)  # measured stage times by n
    # measured stage times of plain pipeline-parallel runs by n (the last includes the head)
    pp_stage_ms: dict[int, tuple[float, ...]] = field(default_factory=dict)
    tp_layer_ms: dict[int, float] = field(default_factory=dict)  # measured 1/g-width shard per layer

    @property
    def num_layers(self) -> int:
        return len(self.layer_ms)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        known = {"schema", "name", "num_layers", "layer_ms", "pdm_ms", "verify_ms", "hidden_size", "dtype_bytes",
                 "anchors_per_stage", "stage_fixed_ms", "driver_fixed_ms", "stage_ms", "pp_stage_ms", "tp_layer_ms",
                 "source", "measured"}  # source / measured: provenance and raw numbers, not used by the model
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"profile: unknown keys {sorted(unknown)} (schema spd-profile/1)")
        for key in ("layer_ms", "pdm_ms", "verify_ms", "hidden_size"):
            if key not in d:
                raise ValueError(f"profile: missing {key!r} (schema spd-profile/1)")
        layer = d["layer_ms"]
        if isinstance(layer, (int, float)):
            if "num_layers" not in d:
                raise ValueError("profile: a scalar layer_ms needs num_layers")
            layer = [float(layer)] * int(d["num_layers"])
        elif "num_layers" in d and len(layer) != d["num_layers"]:
            raise ValueError(f"profile: {len(layer)} layer_ms entries but num_layers={d['num_layers']}")
        stage_ms, pp_stage_ms = (_stage_table(d, key) for key in ("stage_ms", "pp_stage_ms"))
        prof = cls(name=str(d.get("name", "profile")), layer_ms=tuple(float(x) for x in layer),
                   pdm_ms=_by_n(d["pdm_ms"], "pdm_ms"), verify_ms=float(d["verify_ms"]),
                   hidden=int(d["hidden_size"]), dtype_bytes=int(d.get("dtype_bytes", 2)),
                   anchors=int(d.get("anchors_per_stage", 1)), stage_fixed_ms=float(d.get("stage_fixed_ms", 0.0)),
                   driver_fixed_ms=float(d.get("driver_fixed_ms", 0.0)),
                   stage_ms=stage_ms, pp_stage_ms=pp_stage_ms,
                   tp_layer_ms={int(k): float(v) for k, v in d.get("tp_layer_ms", {}).items()})
        if not prof.layer_ms or min(prof.layer_ms) < 0 or prof.verify_ms < 0 or prof.driver_fixed_ms < 0:
            raise ValueError("profile: layer_ms must be a non-empty list of times >= 0, verify_ms and "
                             "driver_fixed_ms >= 0")
        return prof

    def pdm_for(self, n: int, notes: list[str]) -> float:
        return interp_by_n(self.pdm_ms, n, "pdm_ms", notes)

    def driver_work_for(self, n: int, notes: list[str]) -> float:
        """The driver's per-tick work before verification: PDM + its other host work."""
        return self.pdm_for(n, notes) + self.driver_fixed_ms


# Reference profiles from docs/design.md 6 (one H200, bf16, batch 1, context 1024, CUDA graphs): the
# layer time is the full forward / L; PDM K=2 and LM head + argmax as measured at n=8.
REFERENCE_PROFILES = {
    name: {"num_layers": layers, "layer_ms": forward / layers, "pdm_ms": pdm, "verify_ms": head, "hidden_size": hidden}
    for name, layers, forward, pdm, head, hidden in (
        ("smollm2-135m-h200", 30, 1.97, 0.23, 0.03, 576),
        ("llama-3.2-1b-h200", 16, 1.77, 0.44, 0.17, 2048),
        ("qwen3-4b-h200", 36, 4.77, 0.54, 0.19, 2560),
        ("llama-3.1-8b-h200", 32, 6.19, 0.77, 0.29, 4096))
}


def _interp_bytes(points: tuple[tuple[int, float], ...], nbytes: int) -> float:
    """Piecewise linear in bytes; below the smallest size: its value; above the largest:
    extended at the bandwidth of the last segment."""
    if nbytes <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


@dataclass(frozen=True)
class LinkModel:
    """One class of link (e.g. inside a node or across nodes): measured or explicitly assumed."""

    name: str
    p2p: tuple[tuple[int, float], ...]  # (bytes, one-way ms), sorted by bytes
    post_ms: float  # a host's expected busy time to post one small send
    allreduce: dict[int, tuple[tuple[int, float], ...]]  # ranks -> ((bytes, ms), ...)
    read_ms: float = 0.0  # a host's typical busy time to take in one message that has arrived
    assumed: bool = False

    def hop_ms(self, nbytes: int) -> float:
        return _interp_bytes(self.p2p, nbytes)


    def allreduce_ms(self, ranks: int, nbytes: int, notes: list[str]) -> float:
        if ranks <= 1:
            return 0.0
        if not self.allreduce:
            raise ValueError(f"link {self.name!r} has no all-reduce measurements (run netbench with allreduce)")
        if ranks in self.allreduce:
            return _interp_bytes(self.allreduce[ranks], nbytes)
        keys = sorted(self.allreduce)
        lo = [k for k in keys if k < ranks]
        hi = [k for k in keys if k > ranks]
        if lo and hi:  # between measured group sizes: linear in log2(ranks)
            a, b = lo[-1], hi[0]
            ta, tb = _interp_bytes(self.allreduce[a], nbytes), _interp_bytes(self.allreduce[b], nbytes)
            return ta + (tb - ta) * (math.log2(ranks) - math.log2(a)) / (math.log2(b) - math.log2(a))
        k = lo[-1] if lo else hi[0]
        note(notes, f"all-reduce over {ranks} ranks on {self.name!r} extrapolated from {k} ranks with "
                    f"log2(ranks) scaling (not measured)")
        return _interp_bytes(self.allreduce[k], nbytes) * max(1.0, math.log2(ranks)) / max(1.0, math.log2(k))

    @classmethod
    def from_netbench(cls, report: dict, name: str, stat: str = "idle_mean_us") -> "LinkModel":
        """Hop times: `stat` averaged over the measured pairs. Default idle_mean_us: the mean one-way
        time when the receiver was idle-waiting, as a pipeline stage is (small sizes; larger ones
        fall back to mean_us). Host costs from messages up to 64 KiB: a send costs the mean post
        time (idle variant with idle_* stats), a read of an arrived message the p50 post time."""
        if report.get("schema") != "spd-netbench/1":
            raise ValueError(f"{name}: not an spd-netbench/1 report (schema {report.get('schema')!r})")
        hot = stat.removeprefix("idle_")  # idle statistics exist for small P2P sizes only

        def pick(row: dict) -> float:
            return (row[stat] if stat in row else row[hot]) / 1e3

        by_size: dict[int, list[float]] = {}
        posts, reads = [], []
        for row in report.get("p2p", []):
            by_size.setdefault(row["bytes"], []).append(pick(row))
            if row["bytes"] <= 65536:
                post = row.get("idle_post_mean_us") if stat in row and stat != hot else None
                posts.append((post if post is not None else row.get("post_mean_us", row.get("post_us", 0.0))) / 1e3)
                reads.append(row.get("post_us", 0.0) / 1e3)
        if not by_size:
            raise ValueError(f"{name}: the netbench report has no P2P rows")
        allreduce: dict[int, list[tuple[int, float]]] = {}
        for row in report.get("allreduce", []):
            allreduce.setdefault(row["ranks"], []).append((row["bytes"], pick(row)))
        return cls(name=name, p2p=tuple((b, sum(v) / len(v)) for b, v in sorted(by_size.items())),
                   post_ms=sum(posts) / len(posts) if posts else 0.0,
                   read_ms=sum(reads) / len(reads) if reads else 0.0,
                   allreduce={r: tuple(sorted(v)) for r, v in allreduce.items()})

    @classmethod
    def assume(cls, name: str, latency_us: float, bw_gbps: float, allreduce_us: float | None) -> "LinkModel":
        """An explicit assumption (flagged in every output): hop = latency + bytes / bandwidth;
        all-reduce over r ranks = allreduce_us * log2(r) + 2 (r-1)/r bytes / bandwidth."""
        big = 1 << 26
        p2p = ((1, latency_us / 1e3), (big, latency_us / 1e3 + big / (bw_gbps * 1e6)))
        ar_small = (allreduce_us if allreduce_us is not None else 2 * latency_us) / 1e3
        ring = lambda r: 2 * (r - 1) / r * big / (bw_gbps * 1e6)  # noqa: E731  (bandwidth term of a ring)
        allreduce = {r: ((1, ar_small * math.log2(r)), (big, ar_small * math.log2(r) + ring(r)))
                     for r in (2, 4, 8, 16, 32, 64)}
        return cls(name=name, p2p=p2p, post_ms=0.0, allreduce=allreduce, assumed=True)


class AlphaCurve:
    """Acceptance alpha per n: measured points, linear in between, held constant outside."""

    def __init__(self, points: dict[int, float]):
        if not points:
            raise ValueError("no alpha given")
        for n, a in points.items():
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"alpha for n={n} must be in [0, 1], got {a}")
        self.points = dict(points)

    def __call__(self, n: int, notes: list[str]) -> float:
        if list(self.points) == [0]:  # one alpha for every n
            return self.points[0]
        return interp_by_n(self.points, n, "alpha", notes)

    @classmethod
    def from_eval_json(cls, d: dict) -> "AlphaCurve":
        """Accepts {"alpha_by_n": {"4": 0.8}}, {"results": [{"n": 4, "alpha": 0.8}, ...]} or {"alpha": 0.8}."""
        if "alpha_by_n" in d:
            return cls({int(k): float(v) for k, v in d["alpha_by_n"].items()})
        if "results" in d:
            pts: dict[int, list[float]] = {}
            for r in d["results"]:
                if "n" in r and "alpha" in r:
                    pts.setdefault(int(r["n"]), []).append(float(r["alpha"]))
            if pts:
                return cls({n: sum(v) / len(v) for n, v in pts.items()})
        if "alpha" in d and isinstance(d["alpha"], (int, float)):
            return cls({0: float(d["alpha"])})
        raise ValueError("alpha JSON needs alpha_by_n, results[{n, alpha}] or a scalar alpha")


# ---------------------------------------------------------------- SPD

@dataclass(frozen=True)
class SpdCase:
    """Everything one SPD configuration's tick depends on. Hops are one-way times in ms."""

    stage_ms: tuple[float, ...]
    pdm_ms: float
    verify_ms: float
    alpha: float
    colocate: bool
    hop_token_ms: float  # driver -> stage 0 (unused when co-located)
    hop_act_ms: tuple[float, ...]  # stage p -> p+1, n-1 entries
    hop_anchor_ms: tuple[float, ...]  # stage p -> driver, n-1 entries (last stage sends the exit)
    hop_exit_ms: float  # last stage -> driver: exit + its anchors
    post_ms: float = 0.0  # a rank's busy time per posted send
    recv_ms: float = 0.0  # a rank's busy time per message it reads (and re-posting the receive)

    @property
    def n(self) -> int:
        return len(self.stage_ms)


def spd_cycles(case: SpdCase) -> dict[str, float]:
    """Cycle means (ms per tick) of the steady state with every draft accepted; the tick
    converges to the largest. Per tick the driver reads the anchors of stages first..n-2 in
    order, runs the PDM, then reads the exit and verifies (docs/design.md 3.3)."""
    c, n, po, rv = case.stage_ms, case.n, case.post_ms, case.recv_ms
    first = 1 if case.colocate else 0
    out = {}
    for p in range(first, n):
        out[f"stage {p} compute"] = rv + c[p] + (1 if p == n - 1 else 2) * po
    reads = (n - first) * rv  # anchors of stages first..n-2, then the exit
    if case.colocate:
        out["rank 0: stage 0 + driver (PDM + verify)"] = c[0] + po + reads + case.pdm_ms + case.verify_ms
    else:
        out["driver: PDM + verify"] = po + reads + case.pdm_ms + case.verify_ms
    tok = 0.0 if case.colocate else case.hop_token_ms
    out["verify loop (token through all stages, verify, next token)"] = (
        tok + sum(c) + sum(case.hop_act_ms) + case.hop_exit_ms + (n - first + 1) * rv + case.verify_ms) / n
    for p in range(first, n - 1):
        delay = (tok + sum(c[:p + 1]) + sum(case.hop_act_ms[:p]) + (p + 1 - first) * rv + po
                 + case.hop_anchor_ms[p] + (n - 1 - p) * rv + case.pdm_ms + rv + case.verify_ms)
        out[f"anchor loop via stage {p}"] = delay / (p + 2)
    return out


def simulate_spd(case: SpdCase, decode_tokens: int = 1000, seed: int = 0) -> dict:
    """Evaluate the tick recurrences; returns mean tick time over all ticks incl. refills.
    The driver reads each stage's messages in FIFO order, paying `recv_ms` per message, stale
    ones included, exactly when a later message of that stage is needed."""
    n, c, po, rv = case.n, case.stage_ms, case.post_ms, case.recv_ms
    rng = random.Random(seed)
    free = [0.0] * n  # when each stage can start its next token
    msgs = [[0.0] for _ in range(n)]  # msgs[p][e]: arrival at the driver of stage p's message for token e
    read = [0] * n  # messages the driver has consumed per stage
    epoch_of = [-1, 0]
    epoch = committed = tick = 0
    prev_send = 0.0  # when the driver made the token of this tick known (x_P at time 0)
    first = 1 if case.colocate else 0

    def consume(p: int, entry: int, t: float) -> float:
        for m in range(read[p] + 1, entry + 1):
            t = max(t, msgs[p][m]) + rv
        read[p] = max(read[p], entry)
        return t

    while True:
        tick += 1
        if case.colocate:  # rank 0 runs stage 0 on this tick's token first
            end0 = prev_send + c[0]
            arrive, ready = end0 + case.hop_act_ms[0], end0 + po
        else:
            arrive, ready = prev_send + case.hop_token_ms, prev_send + po
        for p in range(first, n):
            end = max(arrive, free[p]) + rv + c[p]  # take in the input (and re-post the receive), compute
            if p == n - 1:
                msgs[p].append(end + case.hop_exit_ms)
                free[p] = end + po
            else:
                arrive = end + case.hop_act_ms[p]
                msgs[p].append(end + po + case.hop_anchor_ms[p])
                free[p] = end + 2 * po
        for p in range(first, n - 1):  # anchors of tick-1 needed by current-epoch rows
            entry = tick - 1 - p
            if entry >= 1 and epoch_of[entry] == epoch:
                ready = consume(p, entry, ready)
        done = ready + case.pdm_ms
        exiting = tick - n + 1
        if exiting >= 1 and epoch_of[exiting] == epoch:
            done = consume(n - 1, exiting, done) + case.verify_ms
            committed += 1
            if rng.random() >= case.alpha:
                epoch += 1
            if committed == decode_tokens:
                return {"tick_ms": done / tick, "ticks": tick, "time_ms": done,
                        "eal_sampled": n * decode_tokens / tick}
        epoch_of.append(epoch)
        prev_send = done


def build_spd_case(stage_ms: list[float], pdm_ms: float, verify_ms: float, alpha: float, colocate: bool,
                   hidden: int, dtype_bytes: int, anchors: int, link_of) -> SpdCase:
    """`link_of(a, b)` gives the LinkModel between devices a and b (driver = device 0;
    stage p is device p+1, or device p when co-located)."""
    n = len(stage_ms)
    sizes = message_bytes(hidden, dtype_bytes, anchors)
    dev = (lambda p: p) if colocate else (lambda p: p + 1)
    post = max(link_of(0, dev(p)).post_ms for p in range(n))
    return SpdCase(
        stage_ms=tuple(stage_ms), pdm_ms=pdm_ms, verify_ms=verify_ms, alpha=alpha, colocate=colocate,
        hop_token_ms=link_of(0, dev(0)).hop_ms(sizes["token"]),
        hop_act_ms=tuple(link_of(dev(p), dev(p + 1)).hop_ms(sizes["activation"]) for p in range(n - 1)),
        hop_anchor_ms=tuple(link_of(0, dev(p)).hop_ms(sizes["anchors"]) for p in range(n - 1)),
        hop_exit_ms=link_of(0, dev(n - 1)).hop_ms(sizes["exit"]), post_ms=post,
        recv_ms=max(link_of(0, dev(p)).read_ms for p in range(n)))


def predict_spd(case: SpdCase, decode_tokens: int = 1000, seed: int = 0) -> dict:
    """Tick time (simulated, rejections included), EAL from alpha, tokens/s, critical cycle."""
    sim = simulate_spd(case, decode_tokens, seed)
    cycles = spd_cycles(case)
    critical = max(cycles, key=cycles.get)
    eal = eal_from_alpha(case.n, case.alpha)
    token_ms = case.n * sim["tick_ms"] / eal
    driver = case.pdm_ms + case.verify_ms
    return {"tick_ms": sim["tick_ms"], "steady_tick_ms": cycles[critical], "critical": critical,
            "eal": eal, "token_ms": token_ms, "tok_s": 1e3 / token_ms,
            "slowest_stage_ms": max(case.stage_ms), "driver_ms": driver,
            "driver_slack_ms": max(case.stage_ms) - driver}


# ---------------------------------------------------------------- partitions and alternatives

def even_partition(num_layers: int, n: int) -> list[int]:
    """The engine's default split: the first L mod n stages get one extra layer."""
    base, extra = divmod(num_layers, n)
    return [base + (1 if p < extra else 0) for p in range(n)]


def balanced_partition(layer_ms: tuple[float, ...], n: int, extra_ms: list[float]) -> list[int]:
    """Contiguous split minimising max_p(stage time + extra_p), e.g. extra_0 = driver work when
    the driver shares stage 0's device; among the splits reaching that maximum, the one with
    the smallest sum of squares (the most even). Two dynamic programmes over prefix sums."""
    num_layers = len(layer_ms)
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n} stages")
    prefix = [0.0]
    for t in layer_ms:
        prefix.append(prefix[-1] + t)

    def solve(cost, combine, limit: float) -> tuple[float, list[int]]:
        inf = float("inf")
        best = [[inf] * (num_layers + 1) for _ in range(n + 1)]
        cut = [[0] * (num_layers + 1) for _ in range(n + 1)]
        best[0][0] = 0.0
        for p in range(1, n + 1):
            for i in range(p, num_layers - (n - p) + 1):  # stage p-1 ends after layer i-1
                for j in range(p - 1, i):
                    stage = prefix[i] - prefix[j] + extra_ms[p - 1]
                    if stage > limit or best[p - 1][j] == inf:
                        continue
                    value = combine(best[p - 1][j], cost(stage))
                    if value < best[p][i]:
                        best[p][i], cut[p][i] = value, j
        counts, i = [], num_layers
        for p in range(n, 0, -1):
            counts.append(i - cut[p][i])
            i = cut[p][i]
        return best[n][num_layers], counts[::-1]

    worst, _ = solve(lambda x: x, max, float("inf"))
    _, counts = solve(lambda x: x * x, lambda a, b: a + b, worst * (1 + 1e-9) + 1e-12)
    return counts


def stage_times(profile: Profile, counts: list[int], shard_layer_ms: tuple[float, ...] | None = None,
                per_layer_extra_ms: float = 0.0) -> list[float]:
    """Per-stage compute: the stage's layers (or their TP shards) + per-layer all-reduces + fixed cost."""
    layers = shard_layer_ms or profile.layer_ms
    out, start = [], 0
    for c in counts:
        out.append(sum(layers[start:start + c]) + c * per_layer_extra_ms + profile.stage_fixed_ms)
        start += c
    return out


def tp_shard_layer_ms(profile: Profile, g: int, notes: list[str]) -> tuple[float, ...]:
    """Per-layer time of a 1/g-width shard: measured if given, else the ideal layer_ms / g (flagged)."""
    if g in profile.tp_layer_ms:
        scale = profile.tp_layer_ms[g] / (sum(profile.layer_ms) / profile.num_layers)
        return tuple(t * scale for t in profile.layer_ms)
    note(notes, "ASSUMPTION: TP shard compute = layer time / g where the profile has no tp_layer_ms for g "
                "(ideal scaling; batch-1 shards scale worse, so this flatters TP)")
    return tuple(t / g for t in profile.layer_ms)


def ar_token_ms(profile: Profile) -> float:
    """Autoregressive decoding on one device: every layer, then the head."""
    return sum(profile.layer_ms) + profile.stage_fixed_ms + profile.verify_ms


def pp_token_ms(profile: Profile, stage_ms: list[float], link_of, head_ms: float) -> float:
    """Plain pipeline parallel on n devices (head on the last stage, `head_ms` unless the last
    stage time includes it): one token through all stages, then its successor: n hops per token
    (n-1 activations + the token back to stage 0)."""
    n = len(stage_ms)
    sizes = message_bytes(profile.hidden, profile.dtype_bytes, profile.anchors)
    hops = sum(link_of(p, p + 1).hop_ms(sizes["activation"]) for p in range(n - 1))
    hops += link_of(n - 1, 0).hop_ms(sizes["token"])
    return sum(stage_ms) + head_ms + hops


def tp_token_ms(profile: Profile, g: int, link, notes: list[str]) -> tuple[float, float]:
    """Tensor parallel over g devices at batch 1: 1/g shards, two all-reduces of [1, H] per layer,
    a vocab-parallel head (verify / g) and one small all-reduce to pick the argmax.
    Returns (ms per token, ms of it in all-reduces)."""
    shard = tp_shard_layer_ms(profile, g, notes)
    act = profile.hidden * profile.dtype_bytes
    comm = 2 * profile.num_layers * link.allreduce_ms(g, act, notes) + link.allreduce_ms(g, 8, notes)
    note(notes, "ASSUMPTION: TP head = verify_ms / g (vocab-parallel) + one 8-byte all-reduce for the argmax")
    return sum(shard) + profile.stage_fixed_ms + profile.verify_ms / g + comm, comm


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Links:
    """Link classes and device placement: devices 0..D-1 fill nodes of `gpus_per_node` in order."""

    intra: LinkModel
    inter: LinkModel | None = None
    gpus_per_node: int | None = None

    def between_nodes(self, node_a: int, node_b: int) -> LinkModel:
        return self.intra if node_a == node_b or self.inter is None else self.inter

    def of_devices(self, a: int, b: int) -> LinkModel:
        if self.gpus_per_node is None:
            return self.intra
        return self.between_nodes(a // self.gpus_per_node, b // self.gpus_per_node)


def _spd_row(profile: Profile, stage_ms: list[float], counts: list[int] | None, n: int, alpha: float,
             colocate: bool, link_of, label: str, devices: int, notes: list[str], sim_tokens: int, seed: int) -> dict:
    case = build_spd_case(stage_ms, profile.driver_work_for(n, notes), profile.verify_ms, alpha, colocate,
                          profile.hidden, profile.dtype_bytes, profile.anchors, link_of)
    pred = predict_spd(case, sim_tokens, seed)
    return {"method": "spd", "n": n, "devices": devices, "layout": "coloc" if colocate else "sep",
            "partition": label, "stage_layers": counts, "stage_ms": [round(c, 4) for c in stage_ms],
            "alpha": alpha, **pred}


def plan(profile: Profile, links: Links, alpha: AlphaCurve, ns: list[int], sim_tokens: int = 1000,
         seed: int = 0) -> dict:
    """Predictions for SPD (separate / co-located driver, even / balanced split), PP, TP and
    TP x SPD hybrids at every n, with the best method per device count."""
    notes: list[str] = []
    if links.intra.assumed or (links.inter is not None and links.inter.assumed):
        note(notes, "ASSUMPTION: some link numbers are assumed, not measured (see links)")
    ar_ms = ar_token_ms(profile)
    rows: list[dict] = []
    for n in ns:
        if n > profile.num_layers:
            continue
        a = alpha(n, notes)
        for colocate in (False, True):
            devices = n if colocate else n + 1
            link_of = links.of_devices  # devices: driver 0, stage p on p (co-located) or p + 1
            if n in profile.stage_ms:
                rows.append(_spd_row(profile, list(profile.stage_ms[n]), None, n, a, colocate, link_of,
                                     "measured", devices, notes, sim_tokens, seed))
                continue
            even = even_partition(profile.num_layers, n)
            driver = profile.driver_work_for(n, notes) + profile.verify_ms
            extra = [driver if (colocate and p == 0) else 0.0 for p in range(n)]
            bal = balanced_partition(profile.layer_ms, n, extra)
            worst = lambda counts: max(t + e for t, e in zip(stage_times(profile, counts), extra))  # noqa: E731
            for label, counts in (("even", even), ("balanced", bal)):
                if label == "balanced" and worst(bal) >= worst(even) - 1e-9:
                    continue  # no better than the default split
                rows.append(_spd_row(profile, stage_times(profile, counts), counts, n, a, colocate, link_of,
                                     label, devices, notes, sim_tokens, seed))
        rows.append(_pp_row(profile, n, links))
        spans = links.gpus_per_node is not None and n > links.gpus_per_node and links.inter is not None
        tp, comm = tp_token_ms(profile, n, links.inter if spans else links.intra, notes)
        rows.append({"method": "tp", "n": n, "devices": n, "layout": "across nodes" if spans else "one node",
                     "partition": "-", "token_ms": tp, "tok_s": 1e3 / tp, "comm_ms": comm})
        rows.extend(_hybrid_rows(profile, links, n, alpha, notes, sim_tokens, seed))
    for r in rows:
        r["speedup_vs_ar"] = ar_ms / r["token_ms"]
    return {"profile": profile.name, "ar_token_ms": ar_ms, "ar_tok_s": 1e3 / ar_ms, "rows": rows,
            "best_by_devices": _best_by_devices(rows), "notes": notes,
            "links": {"intra": _link_label(links.intra), "inter": links.inter and _link_label(links.inter),
                      "gpus_per_node": links.gpus_per_node}}


def _pp_row(profile: Profile, n: int, links: Links) -> dict:
    """Plain pipeline parallel at n. Stage times, best first: measured in a pp run (head included;
    stages that idle between tokens can compute slower than SPD's busy ones, as on a CPU host),
    measured in an SPD run (+ verify for the head), or the stages' share of the layers."""
    counts = None
    if n in profile.pp_stage_ms:
        stages, head, label = list(profile.pp_stage_ms[n]), 0.0, "measured (pp)"
    elif n in profile.stage_ms:
        stages, head, label = list(profile.stage_ms[n]), profile.verify_ms, "measured"
    else:
        counts = even_partition(profile.num_layers, n)
        stages, head, label = stage_times(profile, counts), profile.verify_ms, "even"
    pp = pp_token_ms(profile, stages, links.of_devices, head)
    return {"method": "pp", "n": n, "devices": n, "layout": "-", "partition": label, "stage_layers": counts,
            "stage_ms": [round(c, 4) for c in stages], "token_ms": pp, "tok_s": 1e3 / pp}


def _link_label(link: LinkModel) -> str:
    return link.name + (" (assumed)" if link.assumed else "")


def _hybrid_rows(profile: Profile, links: Links, n: int, alpha: AlphaCurve, notes: list[str], sim_tokens: int,
                 seed: int) -> list[dict]:
    """g-way TP inside a node, s = n / g SPD stages across nodes (stage group p on node p);
    acceptance is that of an s-stage pipeline."""
    rows = []
    act = profile.hidden * profile.dtype_bytes
    for g in (2, 4, 8, 16):
        s = n // g
        if n % g or s < 2 or (links.gpus_per_node is not None and g > links.gpus_per_node):
            continue
        shard = tp_shard_layer_ms(profile, g, notes)
        per_layer_ar = 2 * links.intra.allreduce_ms(g, act, notes)
        counts = even_partition(profile.num_layers, s)
        stage_ms = stage_times(profile, counts, shard, per_layer_ar)
        for colocate in (False, True):
            row = _spd_row(profile, stage_ms, counts, s, alpha(s, notes), colocate, _group_links(links, colocate),
                           "even", g * s + (0 if colocate else 1), notes, sim_tokens, seed)
            row.update(method=f"tp{g}xspd", n=n, spd_stages=s, tp=g)
            rows.append(row)
    return rows


def _group_links(links: Links, colocate: bool):
    """link_of for hybrids: stage group p sits on node p; a separate driver shares node 0."""
    def node(device: int) -> int:
        return device if colocate else max(0, device - 1)

    return lambda a, b: links.between_nodes(node(a), node(b))


def _best_by_devices(rows: list[dict]) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for r in rows:
        d = r["devices"]
        if d not in best or r["tok_s"] > best[d]["tok_s"]:
            best[d] = {"method": r["method"], "layout": r.get("layout"), "partition": r.get("partition"),
                       "tok_s": r["tok_s"], "n": r["n"]}
    return dict(sorted(best.items()))


def recommendation(result: dict) -> list[str]:
    """Plain statements from the numbers: the fastest setup, who wins on the same devices, why."""
    rows = result["rows"]
    top = max(rows, key=lambda r: r["tok_s"])
    lines = [f"fastest overall: {_label(top)} on {top['devices']} devices, {top['tok_s']:.1f} tok/s "
             f"({top['speedup_vs_ar']:.2f}x one-device autoregressive)"]
    wins: dict[str, list[int]] = {}
    for n in sorted({r["n"] for r in rows}):
        same = [r for r in rows if r["devices"] == n]  # resource-matched: exactly n devices
        if same:
            best = max(same, key=lambda r: r["tok_s"])
            who = {"spd": "SPD", "pp": "PP", "tp": "TP"}.get(best["method"], "TP x SPD (hybrid)")
            wins.setdefault(who, []).append(n)
    lines += [f"on the same n devices, {who} is fastest for n = {_ranges(ns)}" for who, ns in wins.items()]
    for n in (min(r["n"] for r in rows), max(r["n"] for r in rows)):
        tp = next((r for r in rows if r["method"] == "tp" and r["n"] == n), None)
        spd = max((r for r in rows if r["method"] == "spd" and r["layout"] == "coloc" and r["n"] == n),
                  key=lambda r: r["tok_s"], default=None)
        if tp and spd:
            lines.append(f"n={n}: TP {tp['token_ms']:.3f} ms/token (all-reduces {tp['comm_ms']:.3f} ms of it); "
                         f"SPD co-located {spd['token_ms']:.3f} ms/token = tick {spd['tick_ms']:.3f} ms x n / EAL "
                         f"{spd['eal']:.2f}, bound by {spd['critical'].split(' (')[0]}")
    lines.append("SPD pays one small hop per stage per tick and hides it behind stage compute; TP pays two "
                 "all-reduces per layer per token: slow or high-latency links favour SPD, fast links favour TP")
    return lines


def _label(r: dict) -> str:
    if r["method"] == "spd":
        return f"SPD n={r['n']} ({r['layout']}, {r['partition']})"
    if r["method"].endswith("xspd"):
        return f"TP{r['tp']} x SPD{r['spd_stages']} ({r['layout']})"
    return f"{r['method'].upper()} n={r['n']}"


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


# ---------------------------------------------------------------- validation against the tick replay

def predict_replay(replay: dict, link: LinkModel, profiled: bool) -> dict:
    """Predict a tick-replay result (bench/tick_replay.py JSON) from link measurements taken in
    a separate netbench run. profiled=False uses the configured compute times; profiled=True
    uses the compute durations the replay measured (what a profile of the stages would give).
    The simulation draws the same seeded accept sequence as the replay, so it must land on the
    same tick count: only timing is predicted, not luck."""
    stage_ms = replay["stage_compute_ms_measured"] if profiled else replay["stage_ms"]
    pdm = replay["pdm_ms_measured"] if profiled else replay["pdm_ms"]
    verify = replay["verify_ms_measured"] if profiled else replay["verify_ms"]
    if profiled and any(c is None for c in stage_ms):
        raise ValueError("replay result lacks measured stage compute times")
    case = build_spd_case(list(stage_ms), pdm, verify, replay["alpha"], replay["colocate"], replay["hidden"],
                          replay["dtype_bytes"], replay["anchors"], lambda a, b: link)
    sim = simulate_spd(case, replay["tokens"] - 1, replay["seed"])
    assert sim["ticks"] == replay["ticks"], f"model ticks {sim['ticks']} != replay ticks {replay['ticks']}"
    cycles = spd_cycles(case)
    return {"tick_ms": sim["tick_ms"], "critical": max(cycles, key=cycles.get),
            "error": sim["tick_ms"] / replay["tick_ms"] - 1.0}
