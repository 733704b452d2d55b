"""Measured splits: the stage split that balanced a run's own per-tick costs, kept per device so that
`--stage-layers balanced` can use it later (docs/design.md 3.15).

`spd bench` measures every SPD row's per-tick costs and names the contiguous split that minimises
its busiest rank (bench/speed.py `split_advice`). It records that advice here, in one JSON file
under the engine's cache (`$SPD_CACHE/measured_splits.json`), keyed by what the costs depend on:
the converted model (its cache directory's name carries its fingerprint), n, T, whether the driver
shares stage 0's rank, the device and the intra-op threads per rank. A later run given
`--stage-layers balanced` with the same key takes the recorded split; without a record, or where
the run's trained head cannot serve it (engine/model/pdm.py `check_pdm_matches`), it takes the even
split and says why. The choice is a measurement of one host at one time: the record names the
command's date and busiest-rank times, and a newer bench on the same key replaces it.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spd_engine.engine.runtime.record_file import RecordFile

BALANCED = "balanced"  # the --stage-layers value that asks for the recorded split
FILE_NAME = "measured_splits.json"


def device_name(device: str, threads: int) -> str:
    """What a split's costs depend on besides the model: the accelerator's name, or the CPU's model
    and core count, and the ranks' intra-op threads."""
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(torch.device(device))}, {threads} thread(s)"
    return f"{cpu_model()}, {os.cpu_count()} cores, {threads} thread(s)"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform's own name
        pass
    return platform.processor() or platform.machine() or "cpu"


@dataclass(frozen=True)
class SplitKey:
    model: str  # the converted model's directory name (name + fingerprint)
    n: int
    tp: int
    colocate: bool
    device: str  # device_name()
    flags: str = ""  # the run's flags that change what a tick computes (tools/measured_args.py split_key)

    def text(self) -> str:
        where = "co-located" if self.colocate else "driver rank"
        return f"{self.model} | n={self.n} | tp={self.tp} | {where} | {self.device}" + (f" | {self.flags}" if self.flags else "")


class SplitStore:
    """The JSON file of measured splits: {"format": 1, "splits": {key text: record}}."""

    def __init__(self, path: Path) -> None:
        self.file = RecordFile(path, "splits", "measured splits")
        self.path = self.file.path

    def lookup(self, key: SplitKey) -> dict | None:
        """The record for `key` (stage_layers, balanced_layers, busiest_ms, balanced_busiest_ms, date,
        head), or None."""
        record = self.file.get(key.text())
        if record is None:
            return None
        ok = isinstance(record, dict) and all(
            isinstance(record.get(k), list) and record[k] and all(isinstance(c, int) and c >= 1 for c in record[k])
            for k in ("stage_layers", "balanced_layers")) and all(
            isinstance(record.get(k), (int, float)) for k in ("busiest_ms", "balanced_busiest_ms"))
        if not ok:
            raise ValueError(f"measured splits file {self.path}: the record for {key.text()!r} is malformed "
                             f"({record!r}); delete it or rerun `spd bench` to replace it")
        return record

    def record(self, key: SplitKey, advice: dict, head: str) -> None:
        """Keep a run's split advice (bench/speed.py split_advice) for `key`, replacing an older one;
        written whole to a temporary file and renamed, so a reader never sees half of it."""
        self.file.put(key.text(), {**{k: advice[k] for k in ("stage_layers", "busiest_ms", "balanced_layers",
                                                            "balanced_busiest_ms")},
                                   "head": head, "date": time.strftime("%Y-%m-%d %H:%M")})


def balanced_choice(record: dict | None, even: list[int], head_serves: Callable[[list[int]], str | None]
                    ) -> tuple[list[int], str]:
    """(split, why) for --stage-layers balanced: the record's balanced split where there is one and
    `head_serves(split)` (None when it can, else the reason), else `even`."""
    if record is None:
        return even, ("no split measured for this model, n and device yet (`spd bench` records one): "
                      f"the even split {even}")
    split = [int(c) for c in record["balanced_layers"]]
    if len(split) != len(even) or sum(split) != sum(even):
        return even, f"the recorded split {split} is for another model or n: the even split {even}"
    refusal = head_serves(split)
    if refusal is not None:
        return even, f"the recorded split {split} does not suit this run's head ({refusal}): the even split {even}"
    return split, (f"stage layers {split}, the split balancing the costs `spd bench` measured here on "
                   f"{record['date']} (busiest rank {record['balanced_busiest_ms']:.2f} ms predicted, "
                   f"{record['busiest_ms']:.2f} at {record['stage_layers']})")
