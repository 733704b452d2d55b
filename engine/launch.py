"""Distributed launch: one process per rank over torch.distributed (gloo on CPU, NCCL on GPU).

`launch(ecfg)` is a context manager yielding the driver-side runtime on rank 0.
- Started by `torchrun` (RANK/WORLD_SIZE set; single node or multi-node rendezvous): every
  process enters; ranks other than 0 serve their stage and exit when the driver shuts down.
- Started plainly: rank 0 is this process and the other ranks are spawned children. There is no
  elastic agent killing survivors, so a dead rank is detected by the others themselves: a
  receive inside a request fails on a closed connection or times out, and the rank exits
  with an error naming (rank, peer, tick).
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist

from spd_engine.engine.run_config import RunConfig
from spd_engine.engine.roles import build_rank
from spd_engine.engine.transport import IDLE_TIMEOUT, DistTransport, TransportError

# Test hook: "RANK:MESSAGES" makes that rank SIGKILL itself after handling MESSAGES messages,
# the same as `kill -9` from outside, to check that no surviving rank hangs.
FAULT_ENV = "SPD_FAULT_KILL_RANK"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_for_rank(rank: int, local_rank: int | None, gpus: int, world: int) -> int:
    """The GPU index of a rank when the device is plain `cuda`: one GPU per rank, LOCAL_RANK
    under torchrun (ranks spread over nodes), else the rank itself (one node)."""
    index = rank if local_rank is None else local_rank
    if index >= gpus:
        raise ValueError(f"--device cuda runs one rank per GPU: rank {rank} needs GPU {index}, this node has "
                         f"{gpus} (world size {world}); NCCL cannot put two ranks on one GPU")
    return index


def rank_config(ecfg: RunConfig, rank: int, world: int) -> RunConfig:
    """This rank's config: plain `cuda` becomes `cuda:K` of gpu_for_rank, made the current device
    (CUDA graphs, streams and NCCL use the current device). `cpu` and an explicit `cuda:K` (every
    rank on that device) stay as given."""
    if ecfg.device != "cuda":
        return ecfg
    local = os.environ.get("LOCAL_RANK")
    index = gpu_for_rank(rank, None if local is None else int(local), torch.cuda.device_count(), world)
    torch.cuda.set_device(index)
    return ecfg.replace(device=f"cuda:{index}")


def _init(ecfg: RunConfig, rank: int, world: int, init_method: str) -> tuple[RunConfig, DistTransport]:
    """(this rank's config, its transport)."""
    ecfg = rank_config(ecfg, rank, world)
    torch.set_num_threads(ecfg.threads_per_rank())
    timeout = datetime.timedelta(seconds=max(60.0, ecfg.timeout_s))
    dist.init_process_group(ecfg.backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    if ecfg.backend == "nccl":
        # NCCL's watchdog aborts any operation pending longer than the group's timeout, which
        # would kill an idle stage between requests; requests bound their own waits
        # (Transport timeouts), so lift it once the bounded rendezvous is done. Not run yet.
        dist.distributed_c10d._set_pg_timeout(IDLE_TIMEOUT)
    return ecfg, DistTransport(rank, world, ecfg.device)


def _serve(ecfg: RunConfig, rank: int, transport: DistTransport) -> None:
    _, worker = build_rank(ecfg, rank, transport)
    assert worker is not None
    fault = os.environ.get(FAULT_ENV, "")
    if fault and int(fault.split(":")[0]) == rank:
        limit = int(fault.split(":")[1])
        for _ in range(limit):
            worker.step()
        os.kill(os.getpid(), signal.SIGKILL)
    worker.serve()


def _child_main(rank: int, world: int, ecfg: RunConfig, init_method: str) -> None:
    try:
        ecfg, transport = _init(ecfg, rank, world, init_method)
        _serve(ecfg, rank, transport)
        dist.destroy_process_group()
    except (TransportError, RuntimeError, ValueError) as err:
        print(f"spd: rank {rank} failed: {err}", file=sys.stderr, flush=True)
        os._exit(1)  # skip process-group teardown, which may wait on the dead peer


def check_head(ecfg: RunConfig) -> None:
    """A PDM head made for another model or another stage split is a user error: say so up front."""
    if ecfg.mode == "spd" and ecfg.pdm != "random":
        from spd_engine.engine.pdm import check_pdm_matches, read_pdm_config

        pcfg, _ = read_pdm_config(ecfg.pdm)
        check_pdm_matches(pcfg, ecfg.cfg, tuple(ecfg.topology.stage_layers))


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def launch(ecfg: RunConfig) -> Iterator[object]:
    world = ecfg.world_size
    if under_torchrun():
        rank, got = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if got != world:
            raise ValueError(f"torchrun started {got} processes; mode {ecfg.mode} with n={ecfg.topology.n} "
                             f"needs world size {world}")
        ecfg, transport = _init(ecfg, rank, world, "env://")
        if rank != 0:
            try:
                _serve(ecfg, rank, transport)
            except (TransportError, RuntimeError) as err:
                print(f"spd: rank {rank} failed: {err}", file=sys.stderr, flush=True)
                os._exit(1)
            dist.destroy_process_group()
            sys.exit(0)
        yield from _drive(ecfg, transport, [])
        return
    check_head(ecfg)  # fail fast, before any rank is spawned
    if ecfg.device == "cuda":
        gpu_for_rank(world - 1, None, torch.cuda.device_count(), world)  # enough GPUs for every rank
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_child_main, args=(r, world, ecfg, init_method), daemon=True)
                for r in range(1, world)]
    for p in children:
        p.start()
    ecfg, transport = _init(ecfg, 0, world, init_method)
    yield from _drive(ecfg, transport, children)


def _drive(ecfg: RunConfig, transport: DistTransport, children: list) -> Iterator[object]:
    ok = False
    try:
        driver, _ = build_rank(ecfg, 0, transport)
        yield driver
        driver.shutdown()
        ok = True
    except BaseException as err:
        # Work objects (queued sends, the failed receive held by this traceback) keep the
        # process group's connections open; drop them so the teardown below really closes them.
        transport.abandon()
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        # Also on error: closing our connections makes every surviving rank's receive fail
        # at once with an error naming us, instead of waiting for its timeout.
        dist.destroy_process_group()
        for p in children:
            p.join(timeout=ecfg.timeout_s if ok else 5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    if ok:
        bad = [(r + 1, p.exitcode) for r, p in enumerate(children) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited with errors: {bad}")
