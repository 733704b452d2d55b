"""What `spd bench` measured on this host and later commands take: the weight layouts per rank
thread count (engine/runtime/measured_layout.py) and the balanced stage splits
(engine/runtime/measured_split.py), each in a store in the engine's cache."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.runtime.run_config import Mode, RunConfig


def split_store():
    """The measured splits (engine/runtime/measured_split.py): `$SPD_MEASURED_SPLITS`, else a file in
    the engine's cache."""
    from spd_engine.checkpoint_tools.fetch import cache_root
    from spd_engine.engine.runtime.measured_split import FILE_NAME, SplitStore

    return SplitStore(Path(os.environ.get("SPD_MEASURED_SPLITS") or cache_root() / FILE_NAME))


def layout_store():
    """The measured weight layouts (engine/runtime/measured_layout.py): `$SPD_MEASURED_LAYOUTS`, else a
    file in the engine's cache."""
    from spd_engine.checkpoint_tools.fetch import cache_root
    from spd_engine.engine.runtime.measured_layout import FILE_NAME, LayoutStore

    return LayoutStore(Path(os.environ.get("SPD_MEASURED_LAYOUTS") or cache_root() / FILE_NAME))


def record_layouts(model: str, cfg: ModelConfig, device: str, counts: list[int], out) -> dict[int, str]:
    """Time the weight layouts on `cfg`'s shapes for ranks of each thread count in `counts`, record the
    fastest for `model` on this device (engine/runtime/measured_layout.py) and say so on `out`."""
    from spd_engine.bench.stage_width_time import time_layouts
    from spd_engine.engine.runtime.measured_layout import layout_key

    store = layout_store()
    chosen = {}
    for threads in counts:
        times = time_layouts(cfg, threads)
        chosen[threads] = store.record(layout_key(model, device, threads), times)
        ms = ", ".join(f"{lay} {times[(lay, 1)]:.1f}/{times[(lay, w)]:.1f}" for lay, w in times if w > 1)
        print(f"weight layout for ranks of {threads} thread(s): {chosen[threads]} (ms per stage step of one/four "
              f"rows: {ms}; recorded in {store.path})", file=out)
    return chosen


def with_measured_layouts(ecfg: RunConfig) -> RunConfig:
    """`ecfg` with the layouts `spd bench` measured for its model on this CPU, for every thread count a
    rank may have here (what `--weight-layout auto` takes); unchanged for a given layout or off a CPU."""
    if ecfg.model.weight_layout != "auto" or not ecfg.parallel.device.startswith("cpu"):
        return ecfg
    threads = tuple(range(1, max(os.cpu_count() or 1, ecfg.parallel.threads or 1) + 1))
    return ecfg.replace(measured_layouts=layout_store().layouts_for(ecfg.model.source, ecfg.parallel.device, threads))


def split_key(ecfg: RunConfig):
    """The measured-split key of this run's model, n, T, driver placement, device and threads, and the
    flags that change what a tick computes (as given: a bench row and a later command with the same
    flags share a key, also where `--weight-layout auto` resolves to another measured layout in between)."""
    from spd_engine.engine.runtime.measured_split import SplitKey, device_name

    topo = ecfg.parallel.topology
    runs = "default" if ecfg.drafting.suffix_run is None else ecfg.drafting.suffix_run
    flags = (f"pdm {ecfg.drafting.pdm_dtype}, head screen {'on' if ecfg.model.head_screen else 'off'}, "
             f"layout {ecfg.model.weight_layout}, verify at {ecfg.parallel.verify_at}, "
             f"suffix drafts {'on, runs ' + str(runs) if ecfg.drafting.suffix_drafts else 'off'}")
    return SplitKey(Path(ecfg.model.source).name, topo.n, topo.tp, topo.colocate,
                    device_name(ecfg.parallel.device, ecfg.threads_per_rank()), flags)


def balanced_split(ecfg: RunConfig, colocate: bool) -> tuple[RunConfig, str]:
    """`ecfg` at the recorded balanced split for its key with the driver placed as `colocate` says
    (else the even split), and why."""
    from spd_engine.engine.model.pdm import check_pdm_matches, read_pdm_config
    from spd_engine.engine.protocol.topology import default_stage_layers
    from spd_engine.engine.runtime.measured_split import balanced_choice

    topo = dataclasses.replace(ecfg.parallel.topology, colocate=colocate)
    even = default_stage_layers(topo.num_layers, topo.n)
    ecfg = ecfg.replace(topology=dataclasses.replace(topo, stage_layers=tuple(even)))

    def head_serves(split: list[int]) -> str | None:
        if ecfg.mode is not Mode.SPD or ecfg.drafting.pdm == "random":
            return None
        try:
            check_pdm_matches(read_pdm_config(ecfg.drafting.pdm)[0], ecfg.model.cfg, tuple(split))
        except ValueError as err:
            return str(err)
        return None

    split, why = balanced_choice(split_store().lookup(split_key(ecfg)), even, head_serves)
    return ecfg.replace(topology=dataclasses.replace(topo, stage_layers=tuple(split))), why
