"""The launch and process-group layer of every multi-process run: the runtime (engine/runtime/launch.py)
and the interconnect benchmark with its tick replay (bench/interconnect.py).

- ranks: `LocalRanks` starts ranks as child processes on this host; under `torchrun` (RANK and
  WORLD_SIZE set, any number of nodes) a process is one rank (`torchrun_rank`);
- joining: `join_group` initialises the default process group with a bounded rendezvous and
  returns the rank's `RankContext`, whose waits and barrier are bounded by its timeout. Across
  hosts it binds to the interface that reaches the rendezvous host (engine/comm/iface.py) and
  checks every rank reaches every peer before connecting the mesh (engine/comm/mesh_check.py):
  a join that cannot complete ends every rank within its timeout with one line saying why;
- errors: a failing rank prints `spd: rank R failed: ...` and exits with status 1 without
  tearing the group down (that can wait on the dead peer): `run_rank`, `fail_rank`. The
  launcher lists every rank's exit status and first error line (`LocalRanks.failure_report`);
- teardown: whatever fails closes its connections at once (a process exit, or
  `leave_group` on the launching rank), so a peer blocked on it fails at once with an error
  naming it rather than waiting for its timeout: a dead rank ends the run on every rank.
There is no elastic agent: nothing kills a survivor from outside, every rank notices by itself.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from spd_engine.engine.comm.iface import FIX, IfaceChoice, apply_iface, choose_iface, interface_addresses, master_host
from spd_engine.engine.comm.mesh_check import JoinError, check_mesh
from spd_engine.engine.comm.transport import IDLE_TIMEOUT

JOIN_GRACE_S = 10.0  # past the join's timeout, the watchdog ends a rank stuck inside the backend


class PeerError(RuntimeError):
    """A receive, send or collective failed or timed out: a peer is dead, stuck or gone."""


class RunFailed(RuntimeError):
    """A launched run ended with an error on at least one rank."""


@dataclass
class RankContext:
    """One rank's view of the default process group; every wait is bounded by `timeout_s`."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    node_rank: int = 0

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for a P2P or collective op; any failure names the rank's operation `what`."""
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:  # gloo/NCCL raise RuntimeError subclasses with transport text
            raise PeerError(f"{what} failed after at most {self.timeout_s:g}s: {err}") from err
        if done is False:
            raise PeerError(f"{what} timed out after {self.timeout_s:g}s")

    def barrier(self, what: str = "barrier") -> None:
        # A bounded barrier: an all-reduce waited with our timeout (dist.barrier has none on NCCL).
        flag = torch.zeros(1, device=self.device)
        self.wait(dist.all_reduce(flag, async_op=True), what)

    def sync(self) -> None:
        """Make host timers meaningful: wait for queued device work (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ---------------------------------------------------------------- which rank, which device

def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class TorchrunRank:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int


def torchrun_rank() -> TorchrunRank:
    """This process's place among torchrun's ranks."""
    env = os.environ
    return TorchrunRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                        int(env.get("GROUP_RANK", 0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_init_method() -> str:
    """A rendezvous address for ranks that all run on this host."""
    return f"tcp://127.0.0.1:{free_port()}"


def resolve_backend(backend: str) -> str:
    """`auto`: NCCL where there are GPUs, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, gloo or nccl")
    return backend


def gpu_for_rank(rank: int, local_rank: int | None, gpus: int, world: int) -> int:
    """The GPU index of a rank when the device is plain `cuda`: one GPU per rank, LOCAL_RANK
    under torchrun (ranks spread over nodes), else the rank itself (one node)."""
    index = rank if local_rank is None else local_rank
    if index >= gpus:
        raise ValueError(f"--device cuda runs one rank per GPU: rank {rank} needs GPU {index}, this node has "
                         f"{gpus} (world size {world}); NCCL cannot put two ranks on one GPU")
    return index


def check_gpus(device: str, world: int) -> None:
    """Fail before any rank starts when plain `cuda` on one node lacks a GPU per rank."""
    if device == "cuda":
        gpu_for_rank(world - 1, None, torch.cuda.device_count(), world)


def rank_device(device: str, rank: int, world: int) -> torch.device:
    """This rank's device: plain `cuda` becomes `cuda:K` of gpu_for_rank, made the current device
    (CUDA graphs, streams and NCCL use the current device). `cpu` and an explicit `cuda:K`
    (every rank on that device) stay as given."""
    if device != "cuda":
        return torch.device(device)
    local = os.environ.get("LOCAL_RANK")
    index = gpu_for_rank(rank, None if local is None else int(local), torch.cuda.device_count(), world)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ---------------------------------------------------------------- joining and leaving the group

def join_group(rank: int, world_size: int, backend: str, device: str, init_method: str, timeout_s: float,
               node_rank: int = 0, idle_waits: bool = False) -> RankContext:
    """Join the default process group as `rank` on `device` (rank_device); the rendezvous waits
    at most `timeout_s`. idle_waits (the runtime, whose stages idle between requests for as long
    as it takes, while each wait inside a request is bounded by the transport): NCCL's watchdog,
    which aborts any operation pending longer than the group's timeout, is lifted after the
    rendezvous. Otherwise (benchmarks, every wait bounded) NCCL's blocking wait makes
    wait(timeout) block the host and honour it. The NCCL paths have not run yet."""
    dev = rank_device(device, rank, world_size)
    if backend == "nccl" and not idle_waits:
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    _connect(rank, world_size, backend, init_method, timeout_s)
    if backend == "nccl" and idle_waits:
        dist.distributed_c10d._set_pg_timeout(IDLE_TIMEOUT)
    return RankContext(rank, world_size, backend, dev, timeout_s, node_rank)


class _JoinWatch:
    """Ends this rank with one line if the join is not over `limit_s` after it began: the backend's
    mesh connect can wait on a peer for longer than the timeout it was given."""

    def __init__(self, rank: int, limit_s: float, choice: IfaceChoice) -> None:
        self.rank, self.limit_s, self.choice = rank, limit_s, choice
        self.stage = "starting"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spd-join-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        if not self._done.wait(self.limit_s):
            fail_rank(self.rank, JoinError(f"could not join the process group within {self.limit_s:g}s while "
                                           f"{self.stage}; this rank advertises {self.choice.describe()}; {FIX}"))

    def done(self) -> None:
        self._done.set()


def _connect(rank: int, world: int, backend: str, init_method: str, timeout_s: float) -> None:
    """Initialise the default process group: interface chosen, rendezvous, reachability check, then
    the backend's mesh; JoinError (one line) where it cannot complete within `timeout_s`."""
    host = master_host(init_method, os.environ)
    choice = choose_iface(os.environ, host, interface_addresses())
    apply_iface(choice, backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    watch = _JoinWatch(rank, timeout_s + JOIN_GRACE_S, choice)
    try:
        watch.stage = f"waiting for the rendezvous at {_where(init_method)}"
        try:
            store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
        except RuntimeError as err:  # the store's connect or wait timed out (DistNetworkError, DistStoreError)
            raise JoinError(f"could not join the process group: the rendezvous at {_where(init_method)} did not "
                            f"complete within {timeout_s:g}s ({_first_line(err)}); every node needs the same "
                            f"--nnodes, --master-addr and --master-port, and a route to that address through "
                            f"its firewall (this rank advertises {choice.describe()})") from err
        store.set_timeout(timeout)
        watch.stage = "checking that every rank reaches every peer"
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        check_mesh(dist.PrefixStore(f"spd-join-{restart}", store), rank, world, choice, deadline)
        watch.stage = f"connecting the {backend} mesh"
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        except RuntimeError as err:  # the backend's own failure after the check passed: still one line
            raise JoinError(f"could not join the process group: the {backend} mesh failed ({_first_line(err)}); "
                            f"this rank advertises {choice.describe()}; {FIX}") from err
    finally:
        watch.done()


def _where(init_method: str) -> str:
    if init_method.startswith("env://"):
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return init_method


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def finish_group(ctx: RankContext) -> None:
    """End a successful run together: nobody closes its connections while a peer still uses
    them (a gloo peer that sees a connection drop mid-teardown can abort)."""
    ctx.barrier("final barrier")
    dist.destroy_process_group()


def leave_group() -> None:
    """Close this rank's connections now (also on error: every peer blocked on us fails at once)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- errors

def report_failure(rank: int, err: BaseException, err_dir: str | None = None) -> None:
    """One line naming the rank on stderr (and into err_dir for the launcher's summary); an
    unexpected kind of error (a bug, not a dead peer or a user error) also gets its traceback."""
    if not isinstance(err, (RuntimeError, ValueError, OSError)):
        traceback.print_exception(err, file=sys.stderr)
    print(f"spd: rank {rank} failed: {err}", file=sys.stderr, flush=True)
    if err_dir is not None:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(str(err) or type(err).__name__)


def fail_rank(rank: int, err: BaseException, err_dir: str | None = None) -> NoReturn:
    """Report and leave at once, skipping the process-group teardown, which can wait on a dead peer."""
    report_failure(rank, err, err_dir)
    sys.stdout.flush()
    os._exit(1)


def run_rank(entry: Callable[..., Any], rank: int, args: tuple, out_dir: str, env: dict[str, str],
             _stdio: None = None) -> NoReturn:
    """A child process's whole life: `entry(rank, *args)`; a result other than None is written
    as JSON for the launcher, an error is reported (fail_rank). `env`: the launcher's environment
    when it started the ranks (a forkserver child has the server's, from when the server started);
    `_stdio`: what a `LauncherStdio` unpickles to, its work done as the rank's process started."""
    os.environ.clear()
    os.environ.update(env)
    try:
        result = entry(rank, *args)
        if result is not None:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(result, f)
    except Exception as err:  # every failure ends this rank with a message naming it
        fail_rank(rank, err, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Start children without re-running the parent's main script in them.

    A spawned child imports the parent's `__main__` file (multiprocessing's preparation data) before
    it runs its target; a user's script that builds an `LLM` at top level, with no
    `if __name__ == "__main__":` guard, would then build one again in every rank and never join.
    The ranks' entry points live in this package, so the children need nothing of `__main__`:
    hide its file and module name while they are started (a notebook or `python -c` has neither)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__spec__ = None  # `python -m x`: the child would run module x again
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


# what every rank imports first (most of a start's cost), and the forkserver's own set-up
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "spd_engine.engine.comm.forkserver_setup")


class LauncherStdio:
    """The launcher's stdout and stderr as they are when a rank starts, handed to that rank (a
    forkserver child would otherwise write where the server's went when the server started)."""

    def __reduce__(self):
        # pickled while the rank's process starts: DupFd passes the descriptors along with it
        return _attach_stdio, (mp.reduction.DupFd(1), mp.reduction.DupFd(2))


def _attach_stdio(out, err) -> None:
    for passed, fd in ((out, 1), (err, 2)):
        got = passed.detach()
        if got != fd:  # a spawned rank inherits the descriptor under its own number: nothing to move
            os.dup2(got, fd)
            os.close(got)


class LocalRanks:
    """Ranks as child processes on this host, each running `run_rank(entry, rank, args)`.

    `start_method`: forkserver (the default, as Python 3.14's: one server process per launching
    process imports `preload` once, and every rank is a fork of it, so a launch costs no interpreter
    start and no torch import per rank after the first) or spawn (a fresh interpreter per rank).
    The server imports nothing else and never touches a GPU, so a fork of it is as clean as a spawn.
    Each rank gets the launcher's environment as it is at the launch, as a spawned one would."""

    def __init__(self, entry: Callable[..., Any], ranks: Iterable[int], args: Sequence = (),
                 start_method: str = "forkserver", preload: Sequence[str] = FORKSERVER_PRELOAD) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="spd-ranks-")
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":  # only before the process's server starts; later calls change nothing
            ctx.set_forkserver_preload(list(preload))
        env = dict(os.environ)
        self.procs = {r: ctx.Process(target=run_rank, args=(entry, r, tuple(args), self._tmp.name, env, LauncherStdio()),
                                     daemon=True)
                      for r in ranks}
        self.hung: list[int] = []

    def __enter__(self) -> "LocalRanks":
        with _main_not_rerun():
            for p in self.procs.values():
                p.start()
        return self

    def __exit__(self, *exc) -> None:
        self.join(0.0)
        self._tmp.cleanup()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` in all for every rank; terminate the ones still running (a
        safety net: ranks time out by themselves long before)."""
        end = time.monotonic() + timeout_s
        for p in self.procs.values():
            if p.pid is not None:
                p.join(max(0.0, end - time.monotonic()))
        for r, p in self.procs.items():
            if p.is_alive():
                self.hung.append(r)
                p.terminate()
                p.join(5.0)

    def exitcodes(self) -> dict[int, int | None]:
        return {r: p.exitcode for r, p in self.procs.items()}

    def failed(self) -> bool:
        return bool(self.hung) or any(code != 0 for code in self.exitcodes().values())

    def failure_report(self) -> str:
        """Every rank's exit status and the first line of its error."""
        codes = self.exitcodes()
        lines = [f"rank {r}: " + ("hung, terminated" if r in self.hung else f"exit code {c}") + self._error(r)
                 for r, c in codes.items()]
        bad = sum(c != 0 for c in codes.values())
        return f"run failed on {bad} of {len(codes)} ranks:\n  " + "\n  ".join(lines)

    def result(self, rank: int) -> Any:
        """What `entry` returned on `rank` (None if nothing)."""
        path = os.path.join(self._tmp.name, f"rank{rank}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _error(self, rank: int) -> str:
        path = os.path.join(self._tmp.name, f"rank{rank}.err")
        if not os.path.exists(path) or not os.path.getsize(path):
            return ""
        with open(path) as f:
            return ": " + f.read().strip().splitlines()[0][:300]
