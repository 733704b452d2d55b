"""What each rank runs, for every mode: the driver side on rank 0, stage workers elsewhere.

Used alike by the distributed launcher (one rank per process) and the reference executor
(ranks in one process over the in-process transport), so both run the same objects.
"""
from __future__ import annotations

import dataclasses

from spd_engine.engine.comm.tp_group import TPGroup
from spd_engine.engine.comm.transport import Transport, loopback_pair
from spd_engine.engine.protocol.messages import link_frames
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.baselines import PipelineDriver
from spd_engine.engine.runtime.build import build_driver_head, build_pdm, build_stage_model, build_tp_stage_model
from spd_engine.engine.runtime.driver import Driver
from spd_engine.engine.runtime.eagle_driver import EagleDriver, build_eagle_driver
from spd_engine.engine.runtime.run_config import Mode, RunConfig
from spd_engine.engine.runtime.stage_worker import StageWorker, wire_format


def rank_topology(ecfg: RunConfig) -> Topology:
    """SPD uses the configured placement; pp, tp and ar always run stage 0 (TP rank 0) on rank 0."""
    if ecfg.mode is Mode.SPD:
        return ecfg.parallel.topology
    return dataclasses.replace(ecfg.parallel.topology, colocate=True)


def build_rank(ecfg: RunConfig, rank: int, transport: Transport, pdm=None, tp_group: TPGroup | None = None
               ) -> tuple[Driver | PipelineDriver | EagleDriver | None, StageWorker | None]:
    """(driver-side runtime or None, stage worker to serve or None) for this rank. tp_group: the
    rank's stage TP group (needed with --tp > 1: engine/comm/tp_group.py)."""
    if ecfg.mode is Mode.EAGLE:  # one rank, no stages and no messages (engine/runtime/eagle_driver.py)
        assert rank == 0 and ecfg.world_size == 1
        return build_eagle_driver(ecfg, head=pdm), None
    topo = rank_topology(ecfg)
    spd = ecfg.mode is Mode.SPD
    plan = ecfg.plan() if spd else None
    wire = wire_format(topo, plan, ecfg.model.cfg.hidden_size, ecfg.verifies_on_last)
    transport.set_frames(link_frames(topo, wire, ecfg.model.torch_dtype.itemsize, ecfg.drafting.branches))
    place = topo.place_of_rank(rank)
    worker, driver_transport = None, transport
    if place is not None:
        stage, tp_rank = place
        parts = dict(embedding=stage == 0, head=stage == topo.n - 1 and wire.head_on_last_stage)
        if topo.tp > 1:
            assert tp_group is not None and tp_group.members == topo.stage_ranks(stage), (rank, tp_group)
            model = build_tp_stage_model(ecfg, topo.layers_of(stage), group=tp_group, **parts)
        else:
            model = build_stage_model(ecfg, topo.layers_of(stage), **parts)
        if rank == topo.driver_rank:
            driver_transport, transport = loopback_pair(transport)
        worker = StageWorker(stage, topo, plan, model, transport, ecfg.rank_options(stage), tp_rank)
    if rank != topo.driver_rank:
        return None, worker
    if not spd:
        return PipelineDriver(topo, worker, driver_transport, ecfg.rank_options()), None
    pdm = pdm if pdm is not None else build_pdm(ecfg)
    driver = Driver(topo, plan, build_driver_head(ecfg), pdm, driver_transport, ecfg.rank_options(),
                    local_stage0=worker)
    return driver, None
