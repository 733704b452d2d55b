"""Reference executor: the SPD runtime in one process.

The driver and the stage workers are the very same classes as in a distributed run; the stages
run as threads over the in-process transport. Results (tokens, tick count, alpha) are
timing-independent by construction (DESIGN 3.3/3.4), so this executor produces exactly what
the distributed run produces; it is what tests, training checks and evaluation use when
wall-clock does not matter.
"""
from __future__ import annotations

import threading

from engine.build import build_driver_head, build_pdm, build_stage_model
from engine.driver import Driver
from engine.engine_config import EngineConfig
from engine.stage_worker import StageWorker
from engine.transport import LocalHub, loopback_pair


class ReferenceExecutor:
    """Use as a context manager; `generate` has the Driver's signature."""

    def __init__(self, ecfg: EngineConfig, pdm=None) -> None:
        assert ecfg.mode == "spd", "the reference executor runs SPD; baselines live in engine.baselines"
        topo, plan = ecfg.topology, ecfg.plan()
        self.hub = LocalHub(topo.world_size)
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        local0 = None
        for s in range(topo.n):
            rank = topo.stage_rank(s)
            lay = topo.layers_of(s)
            model = build_stage_model(ecfg, lay, embedding=s == 0, head=False)
            transport = self.hub.transport(rank)
            if rank == topo.driver_rank:
                driver_transport, transport = loopback_pair(transport)
            worker = StageWorker(s, topo, plan, model, transport, ecfg.capacity, ecfg.prefill_chunk, ecfg.timeout_s)
            if rank == topo.driver_rank:
                local0 = worker
                continue
            th = threading.Thread(target=self._serve, args=(worker, transport), daemon=True, name=f"stage{s}")
            th.start()
            self.threads.append(th)
        if local0 is None:
            driver_transport = self.hub.transport(topo.driver_rank)
        pdm = pdm if pdm is not None else build_pdm(ecfg)
        self.driver = Driver(topo, plan, build_driver_head(ecfg), pdm, driver_transport, ecfg.capacity,
                             ecfg.prefill_chunk, ecfg.timeout_s, local_stage0=local0)

    def _serve(self, worker: StageWorker, transport) -> None:
        try:
            worker.serve()
        except BaseException as err:  # a stage failure must end the run, not hang it
            self.errors.append(err)
            transport.mark_dead()
            raise

    def generate(self, *args, **kwargs):
        return self.driver.generate(*args, **kwargs)

    def close(self) -> None:
        if not self.errors:
            self.driver.shutdown()
        for th in self.threads:
            th.join(timeout=10)

    def __enter__(self) -> "ReferenceExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
