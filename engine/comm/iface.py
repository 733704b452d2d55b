"""Which network interface a rank's process group binds to, and so which address it advertises to
its peers.

gloo (and NCCL's bootstrap) otherwise take the address the host name resolves to, which on many
hosts is 127.0.0.1: fine on one host, unreachable from every other node. The choice, first that
applies:
1. `--iface NAME` (the run flags; carried to spawned ranks and torchrun's ranks as SPD_IFACE);
2. GLOO_SOCKET_IFNAME set by the user: honoured as given (and NCCL_SOCKET_IFNAME for NCCL:
   where the user set it, NCCL keeps it, else it gets the same interface as gloo);
3. the interface whose route reaches the rendezvous (master) address: the local address a
   socket connected to it would use, mapped to the interface holding that address; where that
   is loopback (every rank on one host), nothing is set and the backend picks as before.
The lookups touching the host are small functions; `choose_iface` itself is pure.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit

IFACE_ENV = "SPD_IFACE"  # the environment spelling of --iface
GLOO_ENV = "GLOO_SOCKET_IFNAME"
NCCL_ENV = "NCCL_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address
FIX = f"pass --iface NAME (or set {GLOO_ENV}/{NCCL_ENV}) naming the interface on the network the nodes share"


@dataclass(frozen=True)
class IfaceChoice:
    """name: the interface (None: leave the backend's own choice); address: what this rank
    advertises on it (None where unknown); source: why this interface, for error messages."""

    name: str | None
    address: str | None
    source: str

    def describe(self) -> str:
        where = self.address or "an address the backend picks"
        return f"{where} (interface {self.name or '?'}, {self.source})"


def master_host(init_method: str, env: Mapping[str, str]) -> str | None:
    """The rendezvous host of a process-group init method (env:// reads MASTER_ADDR); None for
    a file:// rendezvous, which names no host."""
    if init_method.startswith("env://"):
        return env.get("MASTER_ADDR") or None
    if init_method.startswith("tcp://"):
        return urlsplit(init_method).hostname
    return None


def parse_if_inet6(text: str) -> dict[str, list[str]]:
    """/proc/net/if_inet6 (one line per address: 32 hex digits, index, prefix, scope, flags, name)
    as {interface: [IPv6 addresses]}."""
    table: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 6 and len(fields[0]) == 32:
            addr = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            table.setdefault(fields[5], []).append(addr)
    return table


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> dict[str, list[str]]:
    """{interface: its addresses} on this host: IPv4 (each interface's primary) and IPv6."""
    table: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        v4 = _ipv4_of(name)
        table[name] = [v4] if v4 else []
    try:
        with open("/proc/net/if_inet6") as f:
            for name, addrs in parse_if_inet6(f.read()).items():
                table.setdefault(name, []).extend(addrs)
    except OSError:  # no IPv6 on this host
        pass
    return table


def route_source(host: str) -> str:
    """The local address this host's routes send packets to `host` from (a UDP socket's connect
    sends nothing; it only picks the route). OSError where `host` does not resolve or no route
    reaches it."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def iface_of(address: str, table: Mapping[str, list[str]]) -> str | None:
    """The interface holding `address` (IPv6 scope suffixes ignored), or None."""
    want = ipaddress.ip_address(address.split("%")[0])
    for name, addrs in table.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addrs):
            return name
    return None


def _first_address(name: str, table: Mapping[str, list[str]]) -> str | None:
    addrs = table.get(name.split(",")[0], [])
    v4 = [a for a in addrs if ipaddress.ip_address(a.split("%")[0]).version == 4]
    return (v4 or addrs or [None])[0]


def choose_iface(env: Mapping[str, str], host: str | None, table: Mapping[str, list[str]],
                 route: Callable[[str], str] = route_source) -> IfaceChoice:
    """This rank's interface (the module's docstring gives the order). ValueError: --iface or
    GLOO_SOCKET_IFNAME names an interface this host does not have."""
    flag = env.get(IFACE_ENV)
    if flag:
        if flag not in table:
            raise ValueError(f"--iface {flag}: no such network interface on this host "
                             f"(it has {', '.join(sorted(table)) or 'none'})")
        return IfaceChoice(flag, _first_address(flag, table), "--iface")
    user = env.get(GLOO_ENV)  # NCCL_SOCKET_IFNAME may be a pattern (^docker, eth): apply_iface keeps it as set
    if user:
        missing = [name for name in user.split(",") if name not in table]
        if missing:
            raise ValueError(f"{GLOO_ENV}={user}: no network interface {', '.join(missing)} on this host "
                             f"(it has {', '.join(sorted(table)) or 'none'})")
        return IfaceChoice(user, _first_address(user, table), f"{GLOO_ENV} as set")
    if host is None:
        return IfaceChoice(None, None, "no rendezvous host to route to")
    try:
        local = route(host)
    except OSError as err:  # unresolvable or unroutable: the rendezvous will say so itself
        return IfaceChoice(None, None, f"no route to {host}: {err.strerror or err}")
    if ipaddress.ip_address(local.split("%")[0]).is_loopback:
        # every rank on this host: whatever the backend picks for itself is reachable, and a
        # launcher's own process (rank 0 of a local run) keeps its environment as it was
        return IfaceChoice(None, None, f"all ranks on this host ({host})")
    return IfaceChoice(iface_of(local, table), local, f"the route to {host}")


def use_iface(name: str | None, env: MutableMapping[str, str] = os.environ) -> None:
    """--iface NAME: checked against this host's interfaces (ValueError) and carried in the
    environment to the ranks this process starts (torchrun's ranks each read their own flag)."""
    if name:
        choose_iface({IFACE_ENV: name}, None, interface_addresses())
        env[IFACE_ENV] = name


def apply_iface(choice: IfaceChoice, backend: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Make the backend bind to the chosen interface: GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME
    for NCCL), set before the process group is made; a variable the user set stays as set
    unless --iface overrides it."""
    if choice.name is None:
        return
    names = [GLOO_ENV] + ([NCCL_ENV] if backend == "nccl" else [])
    for var in names:
        if choice.source == "--iface" or not env.get(var):
            env[var] = choice.name
