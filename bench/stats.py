"""Latency statistics and plain-text tables shared by the benchmarks.

Percentiles use linear interpolation between order statistics (numpy's default), so
p50 <= p90 <= p99 <= max holds for any sample. Jitter is reported as p99 - p50: the extra
latency a tick must budget for one message in a hundred, which is what stalls a pipeline.
"""
from __future__ import annotations

import math
from typing import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between sorted samples."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_us(samples_s: Sequence[float]) -> dict[str, float]:
    """Summary of durations given in seconds, reported in microseconds."""
    us = [s * 1e6 for s in samples_s]
    mean = sum(us) / len(us)
    var = sum((x - mean) ** 2 for x in us) / max(1, len(us) - 1)
    p50 = percentile(us, 50)
    p99 = percentile(us, 99)
    return {
        "iters": len(us),
        "min_us": min(us),
        "p50_us": p50,
        "p90_us": percentile(us, 90),
        "p99_us": p99,
        "max_us": max(us),
        "mean_us": mean,
        "std_us": math.sqrt(var),
        "jitter_us": p99 - p50,
    }


def bandwidth_gbps(nbytes: float, time_us: float) -> float:
    """Bytes per time in GB/s (1e9 bytes per second)."""
    assert time_us > 0, "bandwidth of a non-positive time"
    return nbytes / (time_us * 1e-6) / 1e9


def human_bytes(n: int) -> str:
    """4 -> '4B', 65536 -> '64K', 67108864 -> '64M' (powers of 1024)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def parse_bytes(text: str) -> int:
    """'4' / '4B' / '8K' / '64M' / '1G' -> bytes (powers of 1024)."""
    t = text.strip().upper().removesuffix("B") or "0"
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1], 1)
    digits = t[:-1] if t[-1] in "KMG" else t
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 4, 8K, 64M)") from None
    if value <= 0:
        raise ValueError(f"byte size must be positive, got {text!r}")
    return value


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Right-aligned text table. columns: (key, header, format spec like '.1f' or '')."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key, "")
            line.append(format(value, spec) if spec and isinstance(value, (int, float)) else str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
