"""What each rank runs, for every mode: the driver side on rank 0, stage workers elsewhere.

Used alike by the distributed launcher (one rank per process) and the reference executor
(ranks as threads over the in-process transport), so both run the same objects.
"""
from __future__ import annotations

import dataclasses

from spd_engine.engine.baselines import PipelineDriver
from spd_engine.engine.build import build_driver_head, build_pdm, build_stage_model
from spd_engine.engine.driver import Driver
from spd_engine.engine.eagle_driver import EagleDriver, build_eagle_driver
from spd_engine.engine.run_config import RunConfig
from spd_engine.engine.messages import link_frames
from spd_engine.engine.stage_worker import StageWorker, wire_format
from spd_engine.engine.topology import Topology
from spd_engine.engine.transport import Transport, loopback_pair


def rank_topology(ecfg: RunConfig) -> Topology:
    """SPD uses the configured placement; pp and ar always run stage 0 on rank 0."""
    if ecfg.mode == "spd":
        return ecfg.topology
    return dataclasses.replace(ecfg.topology, colocate=True)


def build_rank(ecfg: RunConfig, rank: int, transport: Transport, pdm=None
               ) -> tuple[Driver | PipelineDriver | EagleDriver | None, StageWorker | None]:
    """(driver-side runtime or None, stage worker to serve or None) for this rank."""
    if ecfg.mode == "eagle":  # one rank, no stages and no messages (engine/eagle_driver.py)
        assert rank == 0 and ecfg.world_size == 1
        return build_eagle_driver(ecfg, head=pdm), None
    topo = rank_topology(ecfg)
    spd = ecfg.mode == "spd"
    plan = ecfg.plan() if spd else None
    wire = wire_format(topo, plan, ecfg.cfg.hidden_size)
    transport.set_frames(link_frames(topo, wire, ecfg.torch_dtype.itemsize))
    stage = topo.stage_of_rank(rank)
    worker, driver_transport = None, transport
    if stage is not None:
        last = stage == topo.n - 1
        model = build_stage_model(ecfg, topo.layers_of(stage), embedding=stage == 0, head=last and not spd)
        if rank == topo.driver_rank:
            driver_transport, transport = loopback_pair(transport)
        worker = StageWorker(stage, topo, plan, model, transport, ecfg.rank_options(stage))
    if rank != topo.driver_rank:
        return None, worker
    if not spd:
        return PipelineDriver(topo, worker, driver_transport, ecfg.rank_options()), None
    pdm = pdm if pdm is not None else build_pdm(ecfg)
    driver = Driver(topo, plan, build_driver_head(ecfg), pdm, driver_transport, ecfg.rank_options(),
                    local_stage0=worker)
    return driver, None
