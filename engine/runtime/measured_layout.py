"""Measured weight layouts: the linear-weight layout (engine/model/linear.py) whose stage steps ran
fastest on this device, kept per model, device and intra-op threads so that `--weight-layout auto`
takes it there (docs/design.md 3.14).

Which kernel multiplies one row by a weight fastest depends on the CPU, not only on the layout: on
a 2-core AMD EPYC (Zen 4) oneDNN's packed step is as fast as a column-major one at one row and
spreads over two threads, while on a 2-core Intel Xeon (Sapphire Rapids) the packed one-row step of
15 SmolLM2 layers took 32.2 ms against column-major's 23.4, and ar with two threads lost a quarter
of its speed to it. So `spd bench` times the layouts on the model's own shapes for each thread
count its rows use (bench/stage_width_time.py `time_layouts`), picks one with `choose_layout` and
records it here, in one JSON file under the engine's cache (`$SPD_CACHE/measured_layouts.json`),
keyed by the converted model and `device_name` (CPU model, cores, threads). A run given
`--weight-layout auto` on a CPU takes the records of its model and device (`RunConfig.
measured_layouts`, looked up once where the run is configured, so every rank and every reference
of the run builds the same layout); without one, resolve_layout's fixed rule.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from spd_engine.engine.model.linear import LAYOUTS
from spd_engine.engine.runtime.measured_split import device_name
from spd_engine.engine.runtime.record_file import RecordFile

FILE_NAME = "measured_layouts.json"
TIMED = ("row", "col", "packed")  # mixed's times follow: col's at one row, packed's above
WIDTHS = (1, 4)  # a one-row tick; a suffix run's or a prefill's several rows
NEAR = 1.03  # one-row times within 3% of the best are a tie, broken by the several-row step


@dataclass(frozen=True)
class LayoutKey:
    model: str  # the converted model's directory name (name + fingerprint)
    device: str  # device_name(): CPU model, cores, intra-op threads

    def text(self) -> str:
        return f"{self.model} | {self.device}"


def layout_key(model: str, device: str, threads: int) -> LayoutKey:
    return LayoutKey(Path(model).name, device_name(device, threads))


def with_mixed(times: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """`times` ((layout, rows) -> ms) with mixed's, where col and packed were timed: a mixed step of one
    row runs col's kernel, of more rows packed's."""
    out = dict(times)
    for (lay, w), ms in times.items():
        if lay == ("col" if w == 1 else "packed") and ("packed" if w == 1 else "col", w) in times:
            out[("mixed", w)] = ms
    return out


def choose_layout(times: dict[tuple[str, int], float]) -> str:
    """The layout of the fastest one-row step, ties (within NEAR) going to the fastest step of the most
    rows timed: a tick carries one row, a suffix run or a prefill chunk several."""
    times = with_mixed(times)
    layouts = sorted({lay for lay, _ in times}, key=LAYOUTS.index)
    if not layouts or any((lay, 1) not in times for lay in layouts):
        raise ValueError(f"layout times need a one-row step for every layout, got {sorted(times)}")
    most = max(w for _, w in times)
    best = min(times[(lay, 1)] for lay in layouts)
    near = [lay for lay in layouts if times[(lay, 1)] <= NEAR * best]
    return min(near, key=lambda lay: (times.get((lay, most), float("inf")), times[(lay, 1)]))


class LayoutStore:
    """The JSON file of measured layouts: {"format": 1, "layouts": {key text: record}}."""

    def __init__(self, path: Path) -> None:
        self.file = RecordFile(path, "layouts", "measured layouts")
        self.path = self.file.path

    def lookup(self, key: LayoutKey, records: dict | None = None) -> str | None:
        """The recorded layout for `key` (in `records`, the file's section already read, else the file's),
        or None."""
        record = (self.file.records() if records is None else records).get(key.text())
        if record is None:
            return None
        if not isinstance(record, dict) or record.get("layout") not in LAYOUTS:
            raise ValueError(f"measured layouts file {self.path}: the record for {key.text()!r} is malformed "
                             f"({record!r}); delete it or rerun `spd bench` to replace it")
        return record["layout"]

    def record(self, key: LayoutKey, times: dict[tuple[str, int], float]) -> str:
        """Choose from `times` and keep the choice with the times it came from; returns the layout."""
        layout = choose_layout(times)
        ms = {f"{lay} x{w}": round(t, 3) for (lay, w), t in sorted(with_mixed(times).items())}
        self.file.put(key.text(), {"layout": layout, "ms": ms, "date": time.strftime("%Y-%m-%d %H:%M")})
        return layout

    def layouts_for(self, model: str, device: str, threads: tuple[int, ...]) -> tuple[tuple[int, str], ...]:
        """(threads, layout) for each thread count with a record for this model and device."""
        records = self.file.records()  # the file once, not once per thread count
        found = ((t, self.lookup(layout_key(model, device, t), records)) for t in threads)
        return tuple((t, lay) for t, lay in found if lay is not None)
