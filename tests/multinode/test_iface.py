"""Choosing the interface a rank advertises (engine/comm/iface.py): the order of --iface, the
user's environment and the route to the rendezvous host, on given interface tables and routes."""
from __future__ import annotations

import pytest

from spd_engine.engine.comm.iface import (
    GLOO_ENV,
    IFACE_ENV,
    NCCL_ENV,
    apply_iface,
    choose_iface,
    iface_of,
    master_host,
    parse_if_inet6,
    use_iface,
)

pytestmark = pytest.mark.pure

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.2", "fd00::2", "fe80::fc:ff:fe00:1"], "ib0": ["10.0.0.7"]}


def route_to(table: dict[str, str]):
    def route(host: str) -> str:
        if host not in table:
            raise OSError(101, "Network is unreachable")
        return table[host]
    return route


def test_master_host_of_each_init_method():
    assert master_host("env://", {"MASTER_ADDR": "10.0.0.1"}) == "10.0.0.1"
    assert master_host("env://", {}) is None
    assert master_host("tcp://node-a:29500", {}) == "node-a"
    assert master_host("tcp://[fd00::1]:29500", {}) == "fd00::1"
    assert master_host("file:///tmp/rdzv", {"MASTER_ADDR": "x"}) is None


def test_if_inet6_lines_become_addresses_per_interface():
    text = ("fd000000000000000000000000000002 04 40 00 82     eth0\n"
            "00000000000000000000000000000001 01 80 10 80       lo\n"
            "fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n")
    assert parse_if_inet6(text) == {"eth0": ["fd00::2", "fe80::fc:ff:fe00:1"], "lo": ["::1"]}
    assert parse_if_inet6("garbage\n") == {}


def test_the_interface_holding_an_address():
    assert iface_of("10.0.0.7", TABLE) == "ib0"
    assert iface_of("fe80::fc:ff:fe00:1%eth0", TABLE) == "eth0"  # scope suffix ignored
    assert iface_of("fd00:0::2", TABLE) == "eth0"  # compared as addresses, not strings
    assert iface_of("203.0.113.9", TABLE) is None


def test_route_to_the_master_picks_the_interface_that_reaches_it():
    route = route_to({"10.0.0.1": "10.0.0.7", "127.0.0.1": "127.0.0.1"})
    choice = choose_iface({}, "10.0.0.1", TABLE, route)
    assert (choice.name, choice.address) == ("ib0", "10.0.0.7")
    assert "route to 10.0.0.1" in choice.source
    one_host = choose_iface({}, "127.0.0.1", TABLE, route)  # one host: the backend's own pick reaches
    assert one_host.name is None and "all ranks on this host" in one_host.source
    env: dict[str, str] = {}
    apply_iface(one_host, "gloo", env)
    assert env == {}  # a local launcher's environment stays as it was


def test_flag_beats_environment_beats_route():
    route = route_to({"10.0.0.1": "10.0.0.7"})
    env = {GLOO_ENV: "eth0", IFACE_ENV: "lo"}
    assert choose_iface(env, "10.0.0.1", TABLE, route).source == "--iface"
    assert choose_iface(env, "10.0.0.1", TABLE, route).address == "127.0.0.1"  # IPv4 first
    del env[IFACE_ENV]
    user = choose_iface(env, "10.0.0.1", TABLE, route)
    assert (user.name, user.address, user.source) == ("eth0", "192.0.2.2", f"{GLOO_ENV} as set")
    # NCCL's variable may be a pattern, never an interface for gloo: the route still decides
    assert choose_iface({NCCL_ENV: "^docker"}, "10.0.0.1", TABLE, route).name == "ib0"


def test_unknown_flag_interface_is_a_user_error():
    with pytest.raises(ValueError, match="--iface eth9: no such network interface.*eth0, ib0, lo"):
        choose_iface({IFACE_ENV: "eth9"}, "10.0.0.1", TABLE, route_to({}))
    with pytest.raises(ValueError, match="--iface eth9"):
        use_iface("eth9", {})
    with pytest.raises(ValueError, match=f"{GLOO_ENV}=eth0,eth9: no network interface eth9 on this host"):
        choose_iface({GLOO_ENV: "eth0,eth9"}, "10.0.0.1", TABLE, route_to({}))


def test_no_route_or_no_host_leaves_the_backend_its_own_choice():
    unreachable = choose_iface({}, "10.9.9.9", TABLE, route_to({}))
    assert unreachable.name is None and "no route to 10.9.9.9" in unreachable.source
    assert choose_iface({}, None, TABLE, route_to({})).name is None
    env: dict[str, str] = {}
    apply_iface(unreachable, "gloo", env)
    assert env == {}


def test_apply_sets_the_backend_variables_and_keeps_the_users():
    route = route_to({"10.0.0.1": "10.0.0.7"})
    env: dict[str, str] = {}
    apply_iface(choose_iface(env, "10.0.0.1", TABLE, route), "nccl", env)
    assert env == {GLOO_ENV: "ib0", NCCL_ENV: "ib0"}
    env = {}
    apply_iface(choose_iface(env, "10.0.0.1", TABLE, route), "gloo", env)
    assert env == {GLOO_ENV: "ib0"}  # NCCL's only on NCCL runs
    env = {NCCL_ENV: "^docker"}  # a user's NCCL pattern stays; gloo gets the routed interface
    apply_iface(choose_iface(env, "10.0.0.1", TABLE, route), "nccl", env)
    assert env == {NCCL_ENV: "^docker", GLOO_ENV: "ib0"}
    env = {GLOO_ENV: "eth0", IFACE_ENV: "lo"}  # --iface overrides what was set
    apply_iface(choose_iface(env, "10.0.0.1", TABLE, route), "nccl", env)
    assert env[GLOO_ENV] == "lo" and env[NCCL_ENV] == "lo"
