"""The reachability check every rank runs before the process group connects its full mesh.

A backend whose ranks advertise an address a peer cannot reach (a loopback address, the wrong
interface, a firewalled port) fails with a transport trace on some ranks while the others wait
for connections that never come. Instead, each rank listens on the address it will advertise,
publishes it in the rendezvous store, opens a connection to every peer's, and publishes what it
found; then every rank reads every report, so all of them fail together, at once, with one line
naming the address advertised, the peer that could not be reached and the fix.
"""
from __future__ import annotations

import datetime
import json
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from spd_engine.engine.comm.iface import FIX, IfaceChoice

CONNECT_S = 5.0  # one probe connection: a reachable peer answers in well under a second


class JoinError(RuntimeError):
    """This rank cannot join the process group; the message is the one line that says why."""


@dataclass(frozen=True)
class Advert:
    rank: int
    address: str
    port: int
    iface: str | None
    source: str

    def peer(self) -> str:
        return f"rank {self.rank} at {self.address}:{self.port} (interface {self.iface or '?'}, {self.source})"


def default_address() -> str:
    """The address a backend left to itself advertises: the first local address the host name
    resolves to, else loopback (gloo's own rule)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError:  # not an address of this host
            continue
    return "127.0.0.1"


def _wait(store: dist.Store, keys: list[str], deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=max(0.1, left)))
    except RuntimeError as err:  # the store's timeout (DistStoreError and kin)
        missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
        raise JoinError(f"could not join the process group: {what}: rank(s) {', '.join(missing) or '?'} did not "
                        f"report within the join deadline ({err.__class__.__name__}); is every node started with "
                        f"the same --nnodes, --master-addr and --master-port?") from err


def _probe(advert: Advert) -> str | None:
    """None if a connection to the peer's advertised address opens, else why not."""
    try:
        with socket.create_connection((advert.address, advert.port), timeout=CONNECT_S):
            return None
    except OSError as err:
        return err.strerror or str(err) or type(err).__name__


def check_mesh(store: dist.Store, rank: int, world: int, me: IfaceChoice, deadline: float) -> None:
    """Every rank's check (collective: all ranks call it); JoinError on every rank where any rank
    cannot reach any peer. `deadline`: time.monotonic() by which the join must be over."""
    address = me.address or default_address()
    me = IfaceChoice(me.name, address, me.source)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        listener = socket.create_server((address.split("%")[0], 0), family=family, backlog=world + 8)
    except OSError as err:
        raise JoinError(f"cannot listen on {me.describe()}: {err.strerror or err}; {FIX}") from err
    with listener:
        mine = Advert(rank, address, listener.getsockname()[1], me.name, me.source)
        store.set(f"advert/{rank}", json.dumps(mine.__dict__))
        _wait(store, [f"advert/{r}" for r in range(world)], deadline, "waiting for every rank's address")
        peers = [Advert(**json.loads(store.get(f"advert/{r}"))) for r in range(world) if r != rank]
        failure = next((f"rank {rank} advertising {me.describe()} cannot reach {p.peer()}: {why}"
                        for p in peers if (why := _probe(p)) is not None), "")
        store.set(f"result/{rank}", failure)
        _wait(store, [f"result/{r}" for r in range(world)], deadline, "waiting for every rank's reachability check")
        reports = [store.get(f"result/{r}").decode() for r in range(world)]
    first = failure or next((r for r in reports if r), "")
    if first:
        here = "" if failure else f"; this rank advertises {me.describe()}"
        raise JoinError(f"could not join the process group: {first}{here}; {FIX}")
