"""Distributed launch of the runtime: one process per rank over torch.distributed (gloo on CPU,
NCCL on GPU), on the process-group layer of engine/comm/dist.py.

`launch(ecfg)` is a context manager yielding the driver-side runtime on rank 0.
- Started by `torchrun` (RANK/WORLD_SIZE set; single node or multi-node rendezvous): every
  process enters; ranks other than 0 serve their stage and exit when the driver shuts down.
- Started plainly: rank 0 is this process and the other ranks are children forked from
  one forkserver (engine/comm/dist.py LocalRanks). There is no
  elastic agent killing survivors, so a dead rank is detected by the others themselves: a
  receive inside a request fails on a closed connection or times out, and the rank exits
  with an error naming (rank, peer, tick).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed

from spd_engine.engine.comm.dist import (
    FORKSERVER_PRELOAD,
    LocalRanks,
    RunFailed,
    check_gpus,
    fail_rank,
    free_port,  # noqa: F401  (re-exported: test harnesses import it from here)
    join_group,
    leave_group,
    local_init_method,
    rank_device,
    torchrun_rank,
    under_torchrun,
)
from spd_engine.engine.comm.mesh_check import JoinError
from spd_engine.engine.comm.shm_transport import ShmTransport, shm_usable
from spd_engine.engine.comm.tp_group import TPGroup, dist_tp_groups
from spd_engine.engine.comm.transport import DistTransport, Transport, rank_nodes, with_link_delay
from spd_engine.engine.runtime.roles import build_rank, rank_topology
from spd_engine.engine.runtime.run_config import Mode, RunConfig

# Test hook: "RANK:MESSAGES" makes that rank SIGKILL itself after handling MESSAGES messages,
# the same as `kill -9` from outside, to check that no surviving rank hangs.
FAULT_ENV = "SPD_FAULT_KILL_RANK"
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # linux/prctl.h
# the forkserver imports this module too (it reads no environment at import), so a rank starts with its
# whole runtime imported; the server is started by this process's first launch
RANK_PRELOAD = (*FORKSERVER_PRELOAD, __name__)


def _bind_to_parent(rank: int) -> None:
    """A launched rank's signals, name and end: SIGINT and SIGTERM are ignored (Ctrl-C and a process-
    group SIGTERM reach every process of the group; the driver alone decides how the run ends and
    closes the ranks), and the rank exits when its launcher process ends, however that ends (SIGKILL,
    os._exit, a crash): a thread waits on the launcher's sentinel (a pipe the launcher holds open), and
    a spawned rank also asks the kernel to SIGKILL it when its launching thread ends. A rank forked
    from the forkserver (engine/comm/dist.py LocalRanks) ties its end to its launcher, not to the
    forkserver (its parent process). The rank is named `spd-rank-R` (ps, top,
    /proc/PID/comm), as the server's tokenizer process is named."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    launcher = multiprocessing.parent_process()  # the process that started us (not the forkserver)
    assert launcher is not None, "a launched rank has a launcher"
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, f"spd-rank-{rank}".encode(), 0, 0, 0)
        if os.getppid() == launcher.pid:  # spawned: the launcher is our parent
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not launcher.is_alive():  # it ended before the watch began
        os._exit(1)
    threading.Thread(target=_exit_with, args=(launcher,), name="spd-launcher-watch", daemon=True).start()


def _exit_with(launcher) -> None:
    launcher.join()  # returns once the launcher's end of the sentinel pipe is closed: it is gone
    os._exit(1)


def _transport(ecfg: RunConfig, rank: int, world: int, one_host: bool, nodes: list[int] | None) -> Transport:
    """The run's P2P transport (collective): `auto` takes shared memory for CPU ranks that this
    process launched on its own host, else the process group's backend."""
    choice = ecfg.parallel.transport
    if choice == "auto":  # one_host, backend and device are the same on every rank
        choice = "gloo"
        if world > 1 and one_host and ecfg.parallel.backend == "gloo" and ecfg.parallel.device.startswith("cpu"):
            # every rank must pick the same: each checks /dev/shm's free space, so they agree on it
            ok = torch.tensor([int(shm_usable(world) is None)])
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
            choice = "shm" if int(ok) else "gloo"
    transport = ShmTransport(rank, world) if choice == "shm" else DistTransport(rank, world, ecfg.parallel.device)
    return with_link_delay(transport, ecfg.parallel.link_delay_us, nodes)


def _join(ecfg: RunConfig, rank: int, world: int, init_method: str) -> tuple[RunConfig, Transport, TPGroup]:
    """(this rank's config: plain `cuda` made this rank's GPU, its transport, its stage's TP group)."""
    device = str(rank_device(ecfg.parallel.device, rank, world))  # before the threads: sets the current GPU
    ecfg = ecfg if device == ecfg.parallel.device else ecfg.replace(device=device)
    torch.set_num_threads(ecfg.threads_per_rank())
    # requests bound their own waits (Transport timeouts); a stage idles between them
    join_group(rank, world, ecfg.parallel.backend, ecfg.parallel.device, init_method, max(60.0, ecfg.runtime.timeout_s),
               idle_waits=True)
    nodes = rank_nodes(rank, world) if ecfg.parallel.link_delay_us else None  # collective, as the two below
    transport = _transport(ecfg, rank, world, not under_torchrun(), nodes)
    return ecfg, transport, dist_tp_groups(rank_topology(ecfg), rank, ecfg.runtime.timeout_s, ecfg.parallel.link_delay_us, nodes)


def _serve(ecfg: RunConfig, rank: int, transport: Transport, group: TPGroup) -> None:
    _, worker = build_rank(ecfg, rank, transport, tp_group=group)
    assert worker is not None
    fault = os.environ.get(FAULT_ENV, "")
    if fault and int(fault.split(":")[0]) == rank:
        limit = int(fault.split(":")[1])
        for _ in range(limit):
            worker.step()
        os.kill(os.getpid(), signal.SIGKILL)
    worker.serve()


def _stage_rank(rank: int, world: int, ecfg: RunConfig, init_method: str) -> None:
    """A launched rank's life (engine/comm/dist.py run_rank reports its error and exits)."""
    _bind_to_parent(rank)
    ecfg, transport, group = _join(ecfg, rank, world, init_method)
    _serve(ecfg, rank, transport, group)
    leave_group()


def check_head(ecfg: RunConfig) -> None:
    """A PDM or EAGLE head made for another model (or another stage split) is a user error: say so up front."""
    if ecfg.mode is Mode.SPD and ecfg.drafting.pdm != "random":
        from spd_engine.engine.model.pdm import check_pdm_matches, read_pdm_config

        pcfg, _ = read_pdm_config(ecfg.drafting.pdm)
        check_pdm_matches(pcfg, ecfg.model.cfg, tuple(ecfg.parallel.topology.stage_layers))
    if ecfg.mode is Mode.EAGLE and ecfg.drafting.eagle_head != "random":
        from spd_engine.engine.model.eagle_head import check_eagle_matches, read_eagle_config

        check_eagle_matches(read_eagle_config(ecfg.drafting.eagle_head)[0], ecfg.model.cfg)


def kill_ranks(procs: list) -> None:
    """SIGKILL rank processes (multiprocessing.Process) and reap them: they ignore SIGTERM, and a
    stopped (SIGSTOP) or hung one would never act on it anyway."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        if p.pid is not None:
            p.join(5.0)


def _join_ranks(ranks: LocalRanks, timeout_s: float) -> None:
    """LocalRanks.join with SIGKILL for the ranks still running at the end (they ignore SIGTERM)."""
    end = time.monotonic() + timeout_s
    for p in ranks.procs.values():
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in ranks.procs.items() if p.is_alive()]
    ranks.hung.extend(hung)
    kill_ranks([ranks.procs[r] for r in hung])


@contextlib.contextmanager
def launch(ecfg: RunConfig, on_ranks: Callable[[dict[int, multiprocessing.Process]], None] | None = None,
           start_method: str = "forkserver") -> Iterator[object]:
    """on_ranks: called with {rank: process} once local ranks have started (not under torchrun),
    so a server can watch and, when it fails, kill them. start_method: how local ranks start
    (engine/comm/dist.py LocalRanks; `spd measure launch-time` compares the two)."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method: forkserver or spawn, got {start_method!r}")
    world = ecfg.world_size
    if under_torchrun():
        me = torchrun_rank()
        if me.world_size != world:
            raise ValueError(f"torchrun started {me.world_size} processes; mode {ecfg.mode} with "
                             f"n={ecfg.parallel.topology.n} needs world size {world}")
        try:
            ecfg, transport, group = _join(ecfg, me.rank, world, "env://")
        except JoinError as err:  # every rank of every node says why in one line and leaves
            fail_rank(me.rank, err)
        if me.rank != 0:
            try:
                _serve(ecfg, me.rank, transport, group)
            except Exception as err:  # a dead peer or a bad message: name this rank, leave at once
                fail_rank(me.rank, err)
            leave_group()
            sys.exit(0)
        yield from _drive(ecfg, transport, group, None)
        return
    check_head(ecfg)  # fail fast, before any rank is spawned
    check_gpus(ecfg.parallel.device, world)  # enough GPUs for every rank
    init_method = local_init_method()
    with LocalRanks(_stage_rank, range(1, world), (world, ecfg, init_method), start_method, RANK_PRELOAD) as ranks:
        if on_ranks is not None:
            on_ranks(dict(ranks.procs))
        # an interpreter exit with the ranks up (Ctrl-C during start-up): multiprocessing's own exit
        # handler would SIGTERM them, which they ignore, and wait for them forever
        at_exit = functools.partial(kill_ranks, list(ranks.procs.values()))
        atexit.register(at_exit)
        try:
            ecfg, transport, group = _join(ecfg, 0, world, init_method)
            yield from _drive(ecfg, transport, group, ranks)
        finally:
            # ranks still up here (rank 0 failed to join, so _drive never ran) ignore the SIGTERM
            # LocalRanks' exit would send them
            kill_ranks([p for p in ranks.procs.values() if p.is_alive()])
            atexit.unregister(at_exit)


def _drive(ecfg: RunConfig, transport: Transport, group: TPGroup, ranks: LocalRanks | None
           ) -> Iterator[object]:
    ok = False
    try:
        driver, _ = build_rank(ecfg, 0, transport, tp_group=group)
        yield driver
        driver.shutdown()
        ok = True
    except BaseException as err:
        if ranks is not None and not isinstance(err, Exception):
            # Ctrl-C or an exit: the ranks have nothing to finish and must not report the driver's
            # departure as their own failure
            kill_ranks(list(ranks.procs.values()))
        # Work objects (queued sends, the failed receive held by this traceback) keep the
        # process group's connections open; drop them so the teardown below really closes them.
        transport.abandon()
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        # Also on error: closing our connections makes every surviving rank's receive fail
        # at once with an error naming us, instead of waiting for its timeout.
        leave_group()
        if ranks is not None:
            _join_ranks(ranks, ecfg.runtime.timeout_s if ok else 5.0)
    if ok and ranks is not None and ranks.failed():
        raise RunFailed(ranks.failure_report())


# `spd` run by this interpreter without the current directory on sys.path: `python -m` would put
# it first, and from the repository root its folders would shadow installed packages (`kernels`).
SPD = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
       "from spd_engine.tools.cli import main; sys.exit(main())")


def spd_command() -> list[str]:
    """argv prefix that runs the `spd` command line with this interpreter, from any directory."""
    return [sys.executable, "-c", SPD]


def spd_script() -> str:
    """The installed `spd` console script beside this interpreter, for launchers that take a script
    (torchrun): run as a script, its own folder heads sys.path, not the working directory."""
    script = Path(sys.executable).with_name("spd")
    if not script.is_file():
        raise FileNotFoundError(f"no `spd` script beside {sys.executable}: install the package (make install)")
    return str(script)
