"""Reference executor: the runtime in one process, for every mode.

The driver and the stage workers are the very same objects as in a distributed run
(engine/runtime/roles.py), over the in-process transport. By default the ranks run in lockstep, all in
the caller's thread, each stage stepping as a message reaches it (engine/comm/lockstep.py: a third
less time a request for a tiny model); TP stages, an overlapped stage 0 and `lockstep=False` run the
stage ranks as threads. SPD
results (tokens, tick count, alpha) are timing-independent by construction (docs/design.md 3.3/3.4),
so this executor produces exactly what the distributed run produces; tests, training checks and
evaluation use it when wall-clock does not matter.
"""
from __future__ import annotations

import threading

from spd_engine.engine.comm.lockstep import LockstepHub
from spd_engine.engine.comm.tp_group import LocalTPHub
from spd_engine.engine.comm.transport import LocalHub
from spd_engine.engine.runtime.roles import build_rank, rank_topology
from spd_engine.engine.runtime.run_config import RunConfig
from spd_engine.engine.runtime.stage_worker import StageWorker


class ReferenceExecutor:
    """Use as a context manager; `generate` has the Driver's signature. lockstep: None picks it
    wherever it can run (one rank per stage, no overlapped stage 0); False keeps the threads (the
    device checks time them; fault tests kill one)."""

    def __init__(self, ecfg: RunConfig, pdm=None, lockstep: bool | None = None) -> None:
        world = ecfg.world_size
        topo = rank_topology(ecfg)
        if lockstep is None:
            lockstep = topo.tp == 1 and not ecfg.parallel.overlap_stage0
        if lockstep and topo.tp > 1:
            raise ValueError(f"lockstep=True needs one rank per stage (tp=1, got tp={topo.tp}): "
                             "TP ranks meet in collectives, so they run as threads")
        if lockstep and ecfg.parallel.overlap_stage0:
            raise ValueError("lockstep=True runs every rank in one thread: overlap_stage0 must be off")
        self.errors: list[BaseException] = []
        self.hub = LockstepHub(world, self.errors) if lockstep else LocalHub(world)
        self.threads: list[threading.Thread] = []
        self.driver = None
        tp_hubs = [LocalTPHub(topo.stage_ranks(s), ecfg.runtime.timeout_s) for s in range(topo.n)]  # one per stage
        # building a TP shard needs no collective, so the ranks are built one after another here
        for rank in range(world):
            transport = self.hub.transport(rank)
            place = topo.place_of_rank(rank)
            group = tp_hubs[place[0]].group(place[1]) if place is not None else None
            driver, worker = build_rank(ecfg, rank, transport, pdm=pdm, tp_group=group)
            if driver is not None:
                self.driver = driver
            if worker is not None and lockstep:
                self.hub.attach(rank, worker.step)
            elif worker is not None:
                th = threading.Thread(target=self._serve, args=(worker, transport, group), daemon=True,
                                      name=f"rank{rank}")
                th.start()
                self.threads.append(th)
        assert self.driver is not None

    def _serve(self, worker: StageWorker, transport, group) -> None:
        try:
            worker.serve()
        except BaseException as err:  # a stage failure must end the run with an error, not hang it
            self.errors.append(err)
            transport.mark_dead()
            if group is not None:
                group.abort()  # the TP peers waiting in a collective fail at once
            raise

    def generate(self, *args, **kwargs):
        return self.driver.generate(*args, **kwargs)

    @property
    def batch(self):
        """The driver's runner of several requests (None before the first generate_batch)."""
        return self.driver.batch

    def check_request(self, *args, **kwargs) -> None:
        self.driver.check_request(*args, **kwargs)

    def generate_batch(self, *args, **kwargs):
        return self.driver.generate_batch(*args, **kwargs)

    def close(self) -> None:
        if not self.errors:
            self.driver.shutdown()
        for th in self.threads:
            th.join(timeout=10)

    def __enter__(self) -> "ReferenceExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
