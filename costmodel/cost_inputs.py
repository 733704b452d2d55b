"""What the cost model is fed (costmodel/cost_model.py, costmodel/cost_model_spd.py): measured compute
(`Profile`, schema spd-profile/1), links (`LinkModel`, from spd netbench or an explicit
assumption), acceptance (`AlphaCurve`) and the wire sizes of SPD's per-tick messages. Pure
arithmetic and parsing: no torch. Times are milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# The head of every frame on the wire: the int64 header fields (engine/protocol/messages.py) and the
# inline flag (engine/comm/transport.py FRAME_HEAD); a number here so the cost model needs no torch,
# tested against the engine
HEADER_BYTES = 72  # the frame head: 8 int64 header fields and the inline flag (engine/comm/transport.py FRAME_HEAD)
TABLE_ROW_BYTES = 80  # a BATCH message's table row: META_LEN int64 fields (engine/protocol/messages.py), tested


# Tensors per decode-tick message: the runtime's transport sends each as one frame (header and
# inline payloads, engine/comm/transport.py; engine/protocol/messages.py link_frames sizes the links for them)
MESSAGE_PARTS = {"token": 1, "activation": 1, "anchors": 1, "exit": 1}


def message_bytes(hidden: int, dtype_bytes: int, anchors: int, table: bool = True) -> dict[str, int]:
    """Wire sizes of the per-tick messages (engine/protocol/messages.py WireFormat): the token to stage
    0, an activation between stages, a stage's anchors to the driver, and the last stage's anchors +
    exit state. SPD's (table): a request alone's one-row BATCH messages, each led by its table row;
    else pp's / tp's TOKEN messages (the token a header alone). A message is its header and its
    payloads, modelled as one hop of their total size."""
    row, table = hidden * dtype_bytes, TABLE_ROW_BYTES if table else 0
    return {"token": HEADER_BYTES + table, "activation": HEADER_BYTES + table + row,  # HEADER_BYTES: the frame's head
            "anchors": HEADER_BYTES + table + anchors * row, "exit": HEADER_BYTES + table + (1 + anchors) * row}


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
    # measured TP all-reduce of one hidden state over g ranks between shard layers (in lockstep with
    # their compute, bench/tp_shard_time.py); where given, the TP row uses it instead of the link's
    tp_allreduce_ms: dict[int, float] = field(default_factory=dict)
    # one host sync (a device-to-host read that waits for the queue), measured by spd profile; every
    # measured step above already includes one, so only the syncs beyond those are charged with it
    sync_ms: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layer_ms)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        known = {"schema", "name", "num_layers", "layer_ms", "pdm_ms", "verify_ms", "hidden_size", "dtype_bytes",
                 "anchors_per_stage", "stage_fixed_ms", "driver_fixed_ms", "stage_ms", "pp_stage_ms", "tp_layer_ms",
                 "tp_allreduce_ms", "sync_ms",
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
                   tp_layer_ms={int(k): float(v) for k, v in d.get("tp_layer_ms", {}).items()},
                   tp_allreduce_ms={int(k): float(v) for k, v in d.get("tp_allreduce_ms", {}).items()},
                   sync_ms=float(d.get("sync_ms", 0.0)))
        if not prof.layer_ms or min(prof.layer_ms) < 0 or min(prof.verify_ms, prof.driver_fixed_ms, prof.sync_ms) < 0:
            raise ValueError("profile: layer_ms must be a non-empty list of times >= 0, verify_ms, "
                             "driver_fixed_ms and sync_ms >= 0")
        return prof

    def pdm_for(self, n: int, notes: list[str]) -> float:
        return interp_by_n(self.pdm_ms, n, "pdm_ms", notes)

    def driver_work_for(self, n: int, notes: list[str]) -> float:
        """The driver's per-tick work before verification: PDM + its other host work + the host
        syncs of reading a full tick's n frame headers (n - 1 anchor messages and the exit; the
        PDM's draft id and the verification's argmax are inside their own measured times)."""
        return self.pdm_for(n, notes) + self.driver_fixed_ms + n * self.sync_ms


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
    # a receive posted after its send was, from posting to completion (0: not measured): what a
    # rendezvous protocol (gloo moves the data once the receive is posted) costs the receiver
    late_ms: float = 0.0
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
    def from_netbench(cls, report: dict, name: str, stat: str = "idle_mean_us", transport: str = "p2p",
                      busy_mb: float = 0.0) -> "LinkModel":
        """Hop times: `stat` averaged over the measured pairs. Default idle_mean_us: the mean one-way
        time when the receiver was idle-waiting, as a pipeline stage is (small sizes; larger ones
        fall back to mean_us). Host costs from messages up to 64 KiB: a send costs the mean post
        time (idle variant with idle_* stats), a read of an arrived message the p50 post time, a
        late receive its mean (p50 with a p50 `stat`) time, where measured.

        transport "gloo" or "shm": the hops of the runtime's own transport instead of raw P2P (the
        `transport` rows of `spd netbench --tests transport`, those measured after `busy_mb` MiB
        of weight streaming on both ends: the hop a computing CPU rank meets). gloo's frames are
        gloo sends underneath, so a send and a read cost what raw P2P's do (where measured); a
        shared-memory send or read is a copy inside the one-way time, not charged to the ranks
        apart (optimistic by those copies)."""
        if report.get("schema") != "spd-netbench/1":
            raise ValueError(f"{name}: not an spd-netbench/1 report (schema {report.get('schema')!r})")
        if transport not in ("p2p", "gloo", "shm"):
            raise ValueError(f"{name}: transport must be p2p, gloo or shm, got {transport!r}")
        if busy_mb and transport == "p2p":
            raise ValueError(f"{name}: busy_mb selects rows of the runtime's transport (gloo or shm), not raw P2P")
        hot = stat.removeprefix("idle_")  # idle statistics exist for small P2P sizes only

        def pick(row: dict) -> float:
            return (row[stat] if stat in row else row[hot]) / 1e3

        by_size: dict[int, list[float]] = {}
        posts, reads, lates = [], [], []
        late_key = "late_p50_us" if "p50" in stat else "late_mean_us"
        for row in report.get("p2p", []):
            if transport == "p2p":
                by_size.setdefault(row["bytes"], []).append(pick(row))
            if row["bytes"] <= 65536:
                post = row.get("idle_post_mean_us") if stat in row and stat != hot else None
                posts.append((post if post is not None else row.get("post_mean_us", row.get("post_us", 0.0))) / 1e3)
                reads.append(row.get("post_us", 0.0) / 1e3)
                if late_key in row:
                    lates.append(row[late_key] / 1e3)
        if transport != "p2p":
            for row in report.get("transport", []):
                if row["transport"] == transport and row["busy_us"] == 0 and row["busy_mb"] == busy_mb:
                    by_size.setdefault(row["bytes"], []).append(pick(row))
            if not by_size:
                raise ValueError(f"{name}: the netbench report has no {transport} transport rows at busy_mb="
                                 f"{busy_mb:g} (spd netbench --tests transport --busy-mb {busy_mb:g})")
            name = f"{name} ({transport}" + (f", after {busy_mb:g} MiB of weights)" if busy_mb else ")")
            if transport == "shm":
                posts, reads, lates = [], [], []
        if not by_size:
            raise ValueError(f"{name}: the netbench report has no P2P rows")
        allreduce: dict[int, list[tuple[int, float]]] = {}
        for row in report.get("allreduce", []):
            allreduce.setdefault(row["ranks"], []).append((row["bytes"], pick(row)))
        return cls(name=name, p2p=tuple((b, sum(v) / len(v)) for b, v in sorted(by_size.items())),
                   post_ms=sum(posts) / len(posts) if posts else 0.0,
                   read_ms=sum(reads) / len(reads) if reads else 0.0,
                   late_ms=sum(lates) / len(lates) if lates else 0.0,
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
